# fp8rl: every target depends on `setup`, which is idempotent (a stamp per pyproject.toml content).
SHELL := /bin/bash
PY_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamp-$(shell sha1sum pyproject.toml | cut -c1-12)
PYTEST_ARGS ?=
BENCH_OUT ?= results/bench

.PHONY: setup test test-fast lint docs demo bench mlflow-ui clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	@# torch first, the CPU build (on disk here): a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -e '.[dev,bench]'
	@rm -f $(VENV)/.stamp-*
	@touch $@

test: setup
	$(PY) -m pytest -q -m "not integration" $(PYTEST_ARGS) tests

test-fast: setup
	$(PY) -m pytest -q -m "not integration and not slow" $(PYTEST_ARGS) tests

lint: setup
	$(PY) -m ruff check fp8rl tests benchmarks
	$(PY) -m fp8rl.docs README.md --check

docs: setup
	$(PY) -m fp8rl.docs README.md --write

demo: setup
	$(PY) -m fp8rl.demo

bench: setup
	$(PY) benchmarks/quant_throughput.py --out $(BENCH_OUT)/quant_throughput.json
	$(PY) benchmarks/clip_overhead.py --out $(BENCH_OUT)/clip_overhead.json
	$(PY) benchmarks/rl_step.py --out $(BENCH_OUT)/rl_step.json

mlflow-ui: setup
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
