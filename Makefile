# The one place commands live. CI, the README and people call these targets.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install system-deps run test test-unit test-integration lint format typecheck bench clean

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## Create or reuse the virtualenv and install the project with its dev tools

system-deps: ## Install the system packages the tests need, when missing (idempotent; uses apt as root)
	@scripts/ensure-system-deps

run: install ## Run the local stack: Redis (embedded unless REDIS_URL is set), worker, beat, Flower, API
	$(VENV)/bin/pipeline run

test: install system-deps ## Run the whole test suite on three processes (each starts its own Redis and workers)
	$(PY) -m pytest -n 3 --dist loadfile $(PYTEST_ARGS)

test-unit: install ## Only the tests that need no services
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

lint: install ## ruff (lint + format check) and mypy --strict
	$(VENV)/bin/ruff check pipeline tasks tests bench
	$(VENV)/bin/ruff format --check pipeline tasks tests bench
	$(VENV)/bin/mypy

format: install ## Apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix pipeline tasks tests bench
	$(VENV)/bin/ruff format pipeline tasks tests bench

typecheck: install ## mypy --strict on pipeline/ and tasks/
	$(VENV)/bin/mypy

bench: install system-deps ## Stock Celery (default settings) vs the pipeline, same Redis, same run (python -m bench --help)
	$(PY) -m bench

clean: ## Remove the virtualenv, caches and local data
	rm -rf $(VENV) .data .mypy_cache .ruff_cache .pytest_cache *.egg-info
