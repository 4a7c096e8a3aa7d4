# `make demo`: set up and run the default experiment (CPU, dummy weights).
# `make test`: set up (with the dev extra: pytest, transformers, triton...) and run the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-dev demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned to the CPU wheel first so that nothing pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "torch==2.13.0" || $(BIN)/pip install --quiet "torch>=2.4"
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

setup-dev: $(VENV)/.installed-dev

demo: setup
	$(BIN)/inferlab run

test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
