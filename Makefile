# Two commands do all the set-up on a fresh Linux machine with Python 3.11+:
#   make demo   creates .venv, installs the framework and the shop's extras, runs the shop demo
#   make test   creates .venv, installs everything (Spark, PostgreSQL, test tools), runs the whole suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test test-fast test-spark bench lint clean chromium

$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required, found " + sys.version.split()[0]' \
		|| { echo "make: set PYTHON=python3.11 (or newer)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.core: $(BIN)/python pyproject.toml
	$(PIP) install -e .
	@touch $@

# the demo's extras: Starlette + uvicorn, PostgreSQL (embedded), Spark (about a minute to install the first time)
$(VENV)/.demo: $(VENV)/.core pyproject.toml
	$(PIP) install -e '.[demo]'
	@touch $@

# (bench: FastStream, so the tests of the peer benchmark run too, not skip)
$(VENV)/.all: $(BIN)/python pyproject.toml
	$(PIP) install -e '.[dev,sql,spark,rabbitmq,bench,demo]'
	@touch $@ $(VENV)/.core $(VENV)/.demo

# CI (CI=true) runs a small shop so the whole run stays well under 3 minutes on 2 cores
DEMO_ARGS ?= $(if $(filter true 1,$(CI)),--orders 200,)
demo: $(VENV)/.demo
	$(BIN)/python -m example_services.demo $(DEMO_ARGS)

# the dashboard's browser tests drive Debian's chromium (Playwright launches it, never downloads one):
# installed here when missing and running as root; otherwise they skip, and fail under CI=true
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; apt-get install -y chromium >/dev/null || { apt-get update >/dev/null && apt-get install -y chromium >/dev/null; }; \
	else echo "make: no /usr/bin/chromium and not root: the dashboard's browser tests will skip (run: sudo apt-get install chromium)"; fi

test: $(VENV)/.all chromium
	$(BIN)/python -m pytest

test-fast: $(VENV)/.all
	$(BIN)/python -m pytest -m "not slow and not spark"

test-spark: $(VENV)/.all
	$(BIN)/python -m pytest -m spark

# the bench extra is the peer measured beside the framework (FastStream); without it its rows say "not run"
$(VENV)/.bench: $(VENV)/.all pyproject.toml
	$(PIP) install -e '.[bench]' || echo "make: the bench extra did not install; the FastStream rows will say not run"
	@touch $@

bench: $(VENV)/.bench
	$(BIN)/python -m benchmarks
	$(BIN)/python -m benchmarks --only dashboard

# ruff; the type checker in strict mode (config: [tool.mypy]); the layer contracts
# (import-linter, [tool.importlinter]); no import circle, imports inside functions counted, and no
# module over 450 lines (tests/layers.py).
lint: $(VENV)/.all
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python tests/layers.py framework broker spark_bridge example_services benchmarks

clean:
	rm -rf $(VENV) .framework .pytest_cache
