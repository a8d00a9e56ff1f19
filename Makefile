PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/relay serve -c conf/relay.yaml

test: $(STAMP)
	$(BIN)/ruff check relay tests
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check relay tests
	$(BIN)/ruff format --check relay tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) var
