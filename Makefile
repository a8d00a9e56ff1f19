PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck bench fuzz clean

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

# A longer run of the inbound fuzzer (tests/test_fuzz_inbound.py); `make test` runs 150 examples.
FUZZ_EXAMPLES ?= 3000
fuzz: $(STAMP)
	RELAY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -q -p no:cacheprovider --timeout=0 \
		tests/test_fuzz_inbound.py

lint: $(STAMP)
	$(BIN)/ruff check relay tests
	$(BIN)/ruff format --check relay tests

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) var
