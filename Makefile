# The README's two set-up commands: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint docs unit audit lock bench bench-run services-up services-down clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "cellstream needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The locks: every package the venv gets, pinned with its hashes (Python 3.11, Linux x86_64), so a fresh
# clone installs what was reviewed and audited; cellstream itself goes on top, without its dependencies.
LOCK := requirements/test.lock
DEMO_LOCK := requirements/demo.lock

# The demo shows every section: the lake needs the parquet extra, the worker node the server extra.
$(VENV)/.base: pyproject.toml $(DEMO_LOCK) | $(BIN)/python
	$(BIN)/pip install -q --require-hashes -r $(DEMO_LOCK)
	$(BIN)/pip install -q --no-deps -e .
	@touch $@

$(VENV)/.test: pyproject.toml $(LOCK) $(VENV)/.base
	$(BIN)/pip install -q --require-hashes -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e .
	@touch $@

## lock: pin pyproject's dependencies again (after editing them), keeping the pins that still fit;
## `make lock LOCK_FLAGS=--upgrade` (or `--upgrade-package NAME`) moves them to newer releases
# uv rather than pip-compile: it resolves for the target (Python 3.11, Linux x86_64) whatever interpreter
# runs it, where pip-compile resolves for its own, and in seconds. Pinned, so relocking is repeatable. The
# demo's lock is constrained by the test lock, so a package both hold has one version.
UV_VERSION := 0.13.9
LOCK_FLAGS ?=
UV_COMPILE = $(BIN)/uv pip compile -q pyproject.toml --generate-hashes --python-version 3.11 \
	--python-platform x86_64-unknown-linux-gnu --custom-compile-command 'make lock' $(LOCK_FLAGS)
lock: | $(BIN)/python
	$(BIN)/pip install -q 'uv==$(UV_VERSION)'
	$(UV_COMPILE) --extra test -o $(LOCK)
	$(UV_COMPILE) --extra parquet --extra server -c $(LOCK) -o $(DEMO_LOCK)

## audit: fail when a locked version has a known advisory (PyPI's data; needs https://pypi.org)
audit: $(VENV)/.test
	$(BIN)/python scripts/audit_lock.py $(LOCK) $(DEMO_LOCK)

## demo: the whole pipeline on the embedded default (SQLite), no server
demo: $(VENV)/.base
	$(BIN)/cellstream demo

## lint: ruff, mypy, the import-layer contract (cellstream -> connectors -> indexer -> tailer -> logstore) and
## the Prometheus alert rules (promtool, from Debian's prometheus package: scripts/install.sh)
lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	@command -v promtool >/dev/null || { echo "lint: promtool is missing: run scripts/install.sh (Debian prometheus)"; exit 1; }
	cd docker/monitoring && promtool check rules alerts.yml && promtool test rules alerts.test.yml

## docs: build the docs site (mkdocs-material) into .site/; a broken link or anchor fails it (not --quiet:
## with it, mkdocs does not count the warnings that --strict fails on)
docs: $(VENV)/.test
	set -o pipefail; NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d .site 2>&1 | { grep -v '^INFO' || true; }

## unit: the tests that need no server (none started) nor browser: SQLite, the CLI, the worker node, the standalone tailer
unit: $(VENV)/.test
	$(BIN)/pytest -m "not mysql and not postgres and not postgres_source and not kafka and not zookeeper and not s3 and not browser"

## test: install the real services, lint, run the whole suite (its session starts the servers it needs and
## stops, at its end, the ones it started: tests/harness/servers.py)
test: $(VENV)/.test
	scripts/install.sh
	$(MAKE) --no-print-directory lint docs audit
	PYTHONFAULTHANDLER=1 $(BIN)/pytest

## bench: the benchmarks against the real services (figures go in docs/benchmarks.md)
bench: $(VENV)/.test
	scripts/install.sh
	$(BIN)/python -m tests.harness.servers run -- $(MAKE) --no-print-directory bench-run

bench-run:
	$(BIN)/python bench/logstore_bench.py
	$(BIN)/python bench/tailer_bench.py
	$(BIN)/python bench/app_bench.py
	$(BIN)/python bench/app_kafka_bench.py
	$(BIN)/python bench/index_bench.py
	$(BIN)/python bench/index_bench.py --mysql
	$(BIN)/python bench/connect_bench.py
	$(BIN)/python bench/iceberg_bench.py
	$(BIN)/python bench/worker_bench.py
	$(BIN)/python bench/write_path_bench.py
	$(BIN)/python bench/rebalance_bench.py
	$(BIN)/python bench/mirror_bench.py
	$(BIN)/python bench/durable_bench.py
	$(BIN)/python bench/pending_bench.py
	$(BIN)/python bench/backup_bench.py
	$(BIN)/python bench/migration_bench.py

## services-up / services-down: keep the shared servers running between test runs (the suite reuses them)
services-up: $(VENV)/.test
	scripts/install.sh
	$(BIN)/python -m tests.harness.servers up

services-down: $(VENV)/.test
	$(BIN)/python -m tests.harness.servers down

clean:
	rm -rf $(VENV) .site .pytest_cache .mypy_cache .ruff_cache *.egg-info
