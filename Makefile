# Two commands do everything on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: train test install clean

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
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) runs outputs build dist *.egg-info
