PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Test processes (pytest-xdist): the end-to-end tests mostly wait on daemons and sockets,
# so more workers than cores shorten `make test` (measured on 2 cores, 4,268 tests: 12.3 min
# with two workers, 10.4 with three, 6.9 with four). TEST_WORKERS=0 runs everything in one
# process.
TEST_WORKERS ?= 4

.PHONY: run test test-tools screenshots lint typecheck bench fuzz coverage mutate clean install docs

# The bootstrap runs under a lock, and checks again once it holds it: `make run` and
# `make test` started together on a fresh clone install once, the second waits.
$(STAMP): pyproject.toml
	@flock $(VENV).lock sh -c '\
	  if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then exit 0; fi; \
	  [ -x $(BIN)/python ] || { $(PY) -m venv $(VENV) && $(BIN)/pip install -q --upgrade pip; } \
	    && $(BIN)/pip install -q -e ".[test]" && touch $(STAMP)'

run: $(STAMP)
	$(BIN)/relay serve -c conf/relay.yaml

# The console's browser tests need Debian's chromium, the alert rules' check promtool (in
# the prometheus package), the man pages' check groff (groff-base): installed here when
# absent and we are root (CI); otherwise, or when apt cannot, those tests skip and print why.
test-tools:
	@missing=""; command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v groff >/dev/null || missing="$$missing groff-base"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "make test: installing$$missing (apt)"; \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing; } >/dev/null 2>&1 \
	      || echo "make test: could not install$$missing: those tests skip"; \
	  else echo "make test:$$missing absent and not root: those tests skip"; fi; \
	fi

test: $(STAMP) test-tools
	$(BIN)/ruff check relay tests bench
	$(BIN)/ruff format --check relay tests bench
	$(BIN)/mypy
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS)

# A PNG of each console page into docs/console/ (README "Console"): a daemon with demo mail,
# driven by Debian's chromium (tests/console_screenshots.py).
screenshots: $(STAMP) test-tools
	$(BIN)/python -m tests.console_screenshots docs/console

# A longer run of the fuzzers: the inbound dialogue (tests/inbound/test_fuzz.py; `make test`
# runs 150 examples through the socket and 500 against the sans-I/O core, ten times as many
# against the core here) and the feedback mail parser (tests/feedback/test_fuzz.py; 40 in
# `make test`, each property).
FUZZ_EXAMPLES ?= 3000
fuzz: $(STAMP)
	RELAY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) RELAY_FUZZ_CORE_EXAMPLES=$$(( $(FUZZ_EXAMPLES) * 10 )) \
		RELAY_CONFIG_FUZZ_EXAMPLES=1000 $(BIN)/pytest -q -p no:cacheprovider --timeout=0 \
		tests/inbound/test_fuzz.py tests/feedback/test_fuzz.py tests/config/test_fuzz.py

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

# The documentation: the reference pages and man pages regenerated from the code
# (relay/cli/docsgen.py), then the site built offline into site/ with no warning allowed, then
# its internal links and #anchors checked (tests/doccheck.py). The docs extra is part of the
# test extra, so $(STAMP) installs MkDocs.
docs: $(STAMP)
	@[ -x $(BIN)/mkdocs ] || $(BIN)/pip install -q -e ".[docs]"
	$(BIN)/python -m relay.cli.docsgen
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site
	$(BIN)/python -m tests.doccheck site

lint: $(STAMP)
	$(BIN)/ruff check relay tests bench
	$(BIN)/ruff format --check relay tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

# `sudo make install`: the program, the unit, the user and group, the config, the credentials
# folder and the spool with its maildrop (README "Running as a service"). DESTDIR stages
# everything under a folder instead (a dry run, or a package): then no user or group is
# created and nothing is chowned. An existing /etc/relay/relay.yaml is never overwritten.
PREFIX ?= /usr/local
RELAY_HOME ?= /opt/relay
SYSCONFDIR ?= /etc
STATEDIR ?= /var/lib/relay
UNITDIR ?= /etc/systemd/system
RELAY_USER ?= relay
RELAY_GROUP ?= relay
CONFDIR := $(SYSCONFDIR)/relay
SPOOLDIR := $(STATEDIR)/spool
ifeq ($(DESTDIR),)
OWNER := -o $(RELAY_USER) -g $(RELAY_GROUP)
else
OWNER :=
endif

install:
	@test -n "$(DESTDIR)" || test "$$(id -u)" = 0 || \
	  { echo "make install: run as root (sudo make install), or stage with DESTDIR=..."; exit 1; }
	# the program: a virtualenv of its own, its commands linked into $(PREFIX)/bin
	[ -x $(DESTDIR)$(RELAY_HOME)/bin/python ] || $(PY) -m venv $(DESTDIR)$(RELAY_HOME)
	$(DESTDIR)$(RELAY_HOME)/bin/python -m pip install -q --upgrade .
	# a staged venv names the staging folder in its scripts' #! lines: name the real one
	[ -z "$(DESTDIR)" ] || grep -lZ "^#!$(DESTDIR)$(RELAY_HOME)/bin/" \
	  $(DESTDIR)$(RELAY_HOME)/bin/* | xargs -0r sed -i "1s|^#!$(DESTDIR)|#!|"
	install -d -m 0755 $(DESTDIR)$(PREFIX)/bin
	ln -sfn $(RELAY_HOME)/bin/relay $(DESTDIR)$(PREFIX)/bin/relay
	ln -sfn $(RELAY_HOME)/bin/relay-sendmail $(DESTDIR)$(PREFIX)/bin/relay-sendmail
	# the man pages (generated by relay/cli/docsgen.py, committed under man/)
	install -d -m 0755 $(DESTDIR)$(PREFIX)/share/man/man1 $(DESTDIR)$(PREFIX)/share/man/man5 \
	  $(DESTDIR)$(PREFIX)/share/man/man8
	install -m 0644 man/relay-sendmail.1 man/mailq.1 $(DESTDIR)$(PREFIX)/share/man/man1/
	install -m 0644 man/relay.yaml.5 $(DESTDIR)$(PREFIX)/share/man/man5/
	install -m 0644 man/relay.8 $(DESTDIR)$(PREFIX)/share/man/man8/
	# the units, pointing at the program where it was installed
	install -d -m 0755 $(DESTDIR)$(UNITDIR)
	for u in relay.service relay@.service; do \
	  sed "s|/opt/relay/bin/|$(RELAY_HOME)/bin/|" systemd/$$u > $(DESTDIR)$(UNITDIR)/$$u.tmp \
	  && chmod 0644 $(DESTDIR)$(UNITDIR)/$$u.tmp && mv $(DESTDIR)$(UNITDIR)/$$u.tmp $(DESTDIR)$(UNITDIR)/$$u; \
	done
	# the daemon's system user; its group `relay` is also the group of apps that may write
	# to the maildrop (relay-sendmail when the daemon does not answer)
	[ -n "$(DESTDIR)" ] || getent group $(RELAY_GROUP) >/dev/null || groupadd --system $(RELAY_GROUP)
	[ -n "$(DESTDIR)" ] || getent passwd $(RELAY_USER) >/dev/null || useradd --system \
	  --gid $(RELAY_GROUP) --home-dir $(STATEDIR) --no-create-home \
	  --shell /usr/sbin/nologin --comment "relay SMTP daemon" $(RELAY_USER)
	# the config (readable by all: it holds no secret, relay-sendmail reads it), with the
	# spool where the unit's StateDirectory= is, and the credentials the unit loads
	install -d -m 0755 $(DESTDIR)$(CONFDIR)
	[ -e $(DESTDIR)$(CONFDIR)/relay.yaml ] || { \
	  sed "s|^  path: \.\./var/spool  |  path: $(SPOOLDIR)|" conf/relay.yaml > $(DESTDIR)$(CONFDIR)/relay.yaml.tmp \
	  && grep -q "^  path: $(SPOOLDIR) " $(DESTDIR)$(CONFDIR)/relay.yaml.tmp \
	  && chmod 0644 $(DESTDIR)$(CONFDIR)/relay.yaml.tmp \
	  && mv $(DESTDIR)$(CONFDIR)/relay.yaml.tmp $(DESTDIR)$(CONFDIR)/relay.yaml; }
	install -d -m 0700 $(DESTDIR)$(CONFDIR)/credentials
	# state: /var/lib/relay and the spool traversable by group relay (0710), nothing more;
	# the maildrop 3730: group relay may create files (setgid: they get group relay, which
	# the daemon reads) but not list or read them; sticky: nobody removes another's file
	install -d -m 0710 $(OWNER) $(DESTDIR)$(STATEDIR)
	install -d -m 0710 $(OWNER) $(DESTDIR)$(SPOOLDIR)
	install -d -m 3730 $(OWNER) $(DESTDIR)$(SPOOLDIR)/maildrop
	[ -n "$(DESTDIR)" ] || systemctl daemon-reload 2>/dev/null || true
	@echo "installed; next: docs/service.md (credentials, then systemctl enable --now relay); man 8 relay"

clean:
	rm -rf $(VENV) $(VENV).lock var .coverage-data htmlcov mutants site
