# Two commands: `make demo` runs every notebook headless into runs/demo/, `make test` runs the tests.
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
# The tiny world's models are too small to gain from several threads, and tests run processes side
# by side: one thread each is faster on a laptop and far faster on a shared 2-core machine.
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-fast install bench lint clean-runs

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
	@$(PY) -m opdkit.demo --out $(DEMO_DIR) $(NOTEBOOKS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Benchmarks against TRL and the ADS scripts (about 25 minutes on 2 CPU cores); see bench/README.md.
bench: install
	$(PY) -m bench.run --out runs/bench $(BENCH_ARGS)

lint: install
	$(PY) -m ruff check opdkit tests

clean-runs:
	rm -rf runs/
