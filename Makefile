# Two entry points on a fresh machine:  `make demo` (the main job) and `make test`.
# Both create .venv and install CPU torch 2.13.0 first: a bare `torch` requirement would pull
# a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ais-train

lint: $(STAMP)
	$(VENV)/bin/ruff check ais_lightning tests tools
	$(VENV)/bin/ruff format --check ais_lightning tests tools

test: lint
	$(VENV)/bin/pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow" -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache outputs multirun
