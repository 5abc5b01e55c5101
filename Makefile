# kvsvc developer commands. `make demo` and `make test` set up everything they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard protos/kvsvc/v1/*.proto)
PYTEST_ARGS ?=

.PHONY: demo test lint proto proto-check bench venv clean

# torch==2.13.0 first: it installs a CPU build from a local file; any other spec pulls a
# multi-GB CUDA build. The worker extra's range then installs nothing more.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/kvsvc demo

test: venv lint
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check kvsvc clients tests benchmarks deploy
	$(VENV)/bin/ruff format --check kvsvc clients tests benchmarks deploy
	$(VENV)/bin/mypy

# Regenerate the one copy of the protobuf/gRPC stubs (kvsvc/v1) from protos/.
proto: venv
	$(PY) -m kvsvc.tools.protogen

proto-check: venv
	$(PY) -m kvsvc.tools.protogen --check

bench: venv
	$(PY) benchmarks/plan_bench.py
	$(PY) benchmarks/core_bench.py
	$(PY) benchmarks/rpc_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
