#!/usr/bin/env bash
# GPU benchmarks for opdkit, under 8 minutes on one H100/H200 (a hard limit of 480 s is enforced; results.json
# is rewritten after every measurement, so the limit loses only the one running): tiny-world and
# Qwen3-0.6B/4B stand-in OPD steps with the kit's loop, with the vLLM engine (where vllm is installed) and
# with TRL (where trl and datasets are), decode tokens/s, train-step MFU, and the full step's CUDA peak
# beside opdkit.memory's plan.
#
#   bash bench/gpu.sh                                    # random stand-ins, results in runs/bench-gpu/
#   bash bench/gpu.sh --student Qwen/Qwen3-0.6B --teacher Qwen/Qwen3-4B
#   bash bench/gpu.sh --peak-tflops 989                  # peak dense bf16 TFLOP/s of your accelerator
#   bash bench/gpu.sh --no-vllm                          # without the vLLM arm
#   bash bench/gpu.sh --vllm-sleep                       # the vLLM arm with vllm_sleep (memory freed between rollouts)
#   bash bench/gpu.sh --dry-run                          # the plan only; no GPU, no datasets/trl/Qwen3 tokenizer
#   bash bench/gpu.sh --smoke                            # toy sizes, any device (what the tests run)
#   bash bench/gpu.sh --help                             # every option
#
# Python: $PYTHON if set, else `python` of the active virtualenv / conda env, else python3 on PATH; it needs a
# torch (a CUDA build on the GPU node) and the wheels in .whl/. On an offline GPU node:
#   make gpu-wheels                                       # where PyPI is reachable: .whl/, ~50 MB
#   pip install --no-index --find-links .whl -r .whl/requirements.txt    # on the node, beside its CUDA torch
#   pip install --no-index --no-deps --no-build-isolation -e .          # the kit itself, from this checkout
# Nothing is downloaded at run time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]]; then PYTHON=python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import torch, transformers, accelerate, safetensors, yaml, tqdm" 2>/dev/null; then
  echo "bench/gpu.sh: $PYTHON ($(command -v "$PYTHON" || echo 'not found')) cannot import torch, transformers," \
    "accelerate, safetensors, yaml and tqdm. Activate the env with your (CUDA) torch and run" \
    "\`pip install --no-index --find-links .whl -r .whl/requirements.txt\` (.whl/ from \`make gpu-wheels\`)," \
    "or point PYTHON=/path/to/python at an interpreter that has them." >&2
  exit 2
fi
if ! "$PYTHON" -c "import opdkit.params" 2>/dev/null; then
  echo "bench/gpu.sh: the kit is not installed in $PYTHON; from here, offline:" \
    "\`$PYTHON -m pip install --no-index --no-deps --no-build-isolation -e .\`" >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout "${BENCH_GPU_TIMEOUT:-480}" "$PYTHON" -m bench.gpu "$@"
