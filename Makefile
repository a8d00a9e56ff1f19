PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Test processes (pytest-xdist): the end-to-end tests mostly wait on daemons and sockets,
# so two workers on two cores halve `make test` (measured: 5.4 min instead of 10).
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

.PHONY: run test lint typecheck bench fuzz coverage mutate clean

# The bootstrap runs under a lock, and checks again once it holds it: `make run` and
# `make test` started together on a fresh clone install once, the second waits.
$(STAMP): pyproject.toml
	@flock $(VENV).lock sh -c '\
	  if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then exit 0; fi; \
	  [ -x $(BIN)/python ] || { $(PY) -m venv $(VENV) && $(BIN)/pip install -q --upgrade pip; } \
	    && $(BIN)/pip install -q -e ".[test]" && touch $(STAMP)'

run: $(STAMP)
	$(BIN)/relay serve -c conf/relay.yaml

test: $(STAMP)
	$(BIN)/ruff check relay tests bench
	$(BIN)/ruff format --check relay tests bench
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

# A longer run of the inbound fuzzer (tests/test_fuzz_inbound.py); `make test` runs 150
# examples through the socket and 500 against the sans-I/O core (ten times as many here).
FUZZ_EXAMPLES ?= 3000
fuzz: $(STAMP)
	RELAY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) RELAY_FUZZ_CORE_EXAMPLES=$$(( $(FUZZ_EXAMPLES) * 10 )) \
		$(BIN)/pytest -q -p no:cacheprovider --timeout=0 tests/test_fuzz_inbound.py

# Coverage of the test process and of every daemon subprocess it starts (coverage.py's
# COVERAGE_PROCESS_START + a .pth hook in the venv); combined report in the terminal and in
# htmlcov/.
coverage: $(STAMP)
	rm -rf .coverage-data && mkdir -p .coverage-data
	echo "import coverage; coverage.process_startup()" > \
		"$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/relay-coverage.pth"
	COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_FILE=$(CURDIR)/.coverage-data/.coverage \
		$(BIN)/coverage run -m pytest -q $(COVERAGE_TESTS) \
		-p no:cacheprovider; status=$$?; \
	export COVERAGE_FILE=$(CURDIR)/.coverage-data/.coverage; $(BIN)/coverage combine -q; \
	$(BIN)/coverage report; $(BIN)/coverage html -q; exit $$status

# The benchmark suite: the relay against Postfix, six scenarios, alternated, medians
# (bench/suite.py; needs root: it installs and starts Debian's postfix). About 15 minutes;
# results in bench/results/. BENCH_ARGS="--only small,serial --rounds 1" for a part.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python bench/suite.py $(BENCH_ARGS)

# Mutation testing (mutmut, configured in pyproject.toml [tool.mutmut]); long, not in `make test`.
mutate: $(STAMP)
	$(BIN)/pip install -q "mutmut>=3.3,<4"
	$(BIN)/mutmut run; $(BIN)/mutmut results

lint: $(STAMP)
	$(BIN)/ruff check relay tests bench
	$(BIN)/ruff format --check relay tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VENV).lock var .coverage-data htmlcov mutants
