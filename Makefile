# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck clean

$(STAMP): pyproject.toml setup.py pwctl/__init__.py  # the package layout: an editable install maps it
	$(PY) -m venv $(VENV)
	# CPU torch first (a local wheel here); an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pwctl demo

test: $(STAMP)
	$(BIN)/ruff check pwctl tests recipes tools
	$(BIN)/pytest -q -n 2

lint: $(STAMP) typecheck
	$(BIN)/ruff check pwctl tests recipes tools

# mypy on pwctl/ (configured in pyproject.toml); `lint` and .ci/run run it
typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
