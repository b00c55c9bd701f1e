# `make setup` is idempotent: a virtual environment in .venv, torch's CPU build, the patched
# llama-cpp-python (cached by the hash of patches/), and this project in editable mode.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.river-edge-deps

.PHONY: setup runtime test test-all demo clean

setup: runtime $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.torch: | $(PY)
	$(PY) -m pip install -q torch==2.13.0
	touch $@

runtime: $(VENV)/.torch
	$(PY) patches/build.py

$(STAMP): pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: setup
	$(PY) -m pytest -q -m "not slow"

test-all: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/river demo

clean:
	rm -rf $(VENV) build *.egg-info
