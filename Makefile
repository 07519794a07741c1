# The one place commands live. CI, the README and people call these targets.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DEV_LOCK   := requirements-dev.lock
PYTEST_ARGS ?=
PY_SCRIPTS := scripts/lock scripts/upgrade-check
SITE_DIR ?= site
MKDOCS_CONFIG ?= mkdocs.yml

.DEFAULT_GOAL := help
.PHONY: help install lock upgrade-check system-deps run test test-install test-cluster test-celery test-celery-stock test-unit test-integration lint format typecheck docs docs-build bench clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

# Exactly the locked versions, each checked against its hash; then the project itself, editable, built by the
# locked setuptools. pyproject.toml's ranges are what the lock is compiled from (make lock).
$(STAMP): $(DEV_LOCK) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(DEV_LOCK)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP) ## Create or reuse the virtualenv and install the locked versions (requirements-dev.lock) and the project

lock: ## Recompile requirements*.lock from pyproject.toml, keeping locked versions it still allows (UPGRADE=1: newest)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) scripts/lock $(if $(UPGRADE),--upgrade)

upgrade-check: install system-deps ## Newest versions (guarded ranges lifted) vs the lock, parity and fault tiers on them; widens what passes (JSON=1)
	$(PY) scripts/upgrade-check $(if $(JSON),--json)

system-deps: ## Install the system packages the tests need, when missing (idempotent; uses apt as root)
	@scripts/ensure-system-deps

run: install ## Run the local stack: Redis (embedded unless REDIS_URL is set), worker, beat, Flower, API
	$(VENV)/bin/pipeline run

# PYTHONDONTWRITEBYTECODE cleared: pytest keeps the modules it rewrites for assertions (the tests', and its plugins'
# such as schemathesis) in __pycache__ only when bytecode may be written; without it each of the five processes
# rewrites them all again, about 7 s of CPU each.
test: install system-deps ## Run the test suite on six processes (each starts its own Redis and workers)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 6 --dist loadfile -m "not install and not cluster" $(PYTEST_ARGS)

# The tests on a real Redis Cluster (3 masters + 3 replicas on loopback ports, one per test process): a CI step of its
# own, as Celery's suite is.
test-cluster: install system-deps ## The tests on a real Redis Cluster (producers, workers, faults, beat, Flower, reads)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 3 --dist loadfile -m cluster $(PYTEST_ARGS)

test-install: install system-deps ## A plain `pip install .` (unlocked, from the index) into a fresh virtualenv starts a worker
	$(PY) -m pytest tests/install -p no:cacheprovider $(PYTEST_ARGS)

# Celery's own integration suite (t/integration of the locked Celery's sdist, its hash checked against the lock) against
# the pipeline's worker on prefork, the asyncio pool and solo; expected failures in tests/celery_suite/expected.txt,
# counts and differences in docs/celery-compat.md. Its own budget: CELERY_SUITE_BUDGET seconds, all variants.
CELERY_SUITE_BUDGET ?= 600
CELERY_SUITE_ARGS ?=
test-celery: install system-deps ## Celery's integration suite against the pipeline's worker (prefork, asyncio pool, solo)
	timeout $(CELERY_SUITE_BUDGET) $(PY) -m tests.celery_suite $(CELERY_SUITE_ARGS)

test-celery-stock: install system-deps ## The same suite against a stock Celery worker: the baseline of test-celery
	timeout $(CELERY_SUITE_BUDGET) $(PY) -m tests.celery_suite stock-prefork $(CELERY_SUITE_ARGS)

test-unit: install ## Only the tests that need no services
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: install ## ruff (lint + format check) and mypy --strict
	$(VENV)/bin/ruff check pipeline tasks tests bench docs/hooks $(PY_SCRIPTS)
	$(VENV)/bin/ruff format --check pipeline tasks tests bench docs/hooks $(PY_SCRIPTS)
	$(VENV)/bin/mypy

format: install ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix pipeline tasks tests bench docs/hooks $(PY_SCRIPTS)
	$(VENV)/bin/ruff format pipeline tasks tests bench docs/hooks $(PY_SCRIPTS)

typecheck: install ## mypy --strict on pipeline/, tasks/ and docs/hooks/
	$(VENV)/bin/mypy

docs: install ## Serve the documentation site on http://127.0.0.1:8001, rebuilt as pages change
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8001

# No --quiet: mkdocs --quiet raises its log level to ERROR, so warnings never reach the strict count and a broken
# link passes. Its INFO lines are the price of a build that can fail (tests/unit/test_docs.py proves it does).
docs-build: install ## Build the documentation site into site/ (SITE_DIR=...) with --strict: any warning fails
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --config-file $(MKDOCS_CONFIG) --site-dir $(SITE_DIR)

bench: install system-deps ## Stock Celery (default settings) vs the pipeline, same Redis, same run; then groups, flows, I/O concurrency, Celery's API, Redis's cost per job, 1 master vs 3 of a Redis Cluster
	$(PY) -m bench
	$(PY) -m bench fairness
	$(PY) -m bench flows
	$(PY) -m bench io_concurrency
	$(PY) -m bench io_concurrency --io-worker 'pipeline worker -Q webhooks -c 34 --loglevel WARNING'
	$(PY) -m bench io_concurrency --latency 2 --jobs 1000 --reps 1
	$(PY) -m bench celery_api
	$(PY) -m bench redis_cost
	$(PY) -m bench cluster

clean: ## Remove the virtualenv, caches and local data
	rm -rf $(VENV) .upgrade-check .data site .mypy_cache .ruff_cache .pytest_cache *.egg-info
