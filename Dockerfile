# syntax=docker/dockerfile:1
#
# kvsvc images, two targets:
#
#   docker build --target server -t kvsvc:server .   # the gRPC server (no torch)
#   docker build --target worker -t kvsvc:worker .   # a worker agent (CPU torch)
#
# `docker build .` without a target builds the server (the last stage).
# Both run as the non-root user kvsvc (UID/GID 10001) and ship a HEALTHCHECK:
# the server's asks its own grpc.health.v1 service (on the port its command listens on),
# the worker's asks its own /metrics (on the port its --metrics-listen names) whether the
# server accepted its allocation (an agent has no gRPC server of its own).
# Ports: gRPC 50051 and /metrics 9400 (the server's defaults), agent /metrics 9401.
# TLS: both HEALTHCHECKs read KVSVC_TLS_CA / KVSVC_TLS_CERT / KVSVC_TLS_KEY (the CA and the
# client certificate of an mTLS server), and the worker's reads its /metrics over HTTPS when
# KVSVC_METRICS_TLS_CERT is set (the variable that makes the agent serve HTTPS): set them in
# the container, nothing here changes (deploy/compose.tls.yaml, deploy/kubernetes-tls/).
# tests/deploy/ run these CMD and HEALTHCHECK commands against live processes.

ARG PYTHON_VERSION=3.11
# The image every stage starts from: a Python with pip and venv, `python` on PATH, and
# groupadd/useradd. Without registry access, deploy/images/build.sh makes a local one from
# the Debian archive and passes it here (--build-arg BASE_IMAGE=...).
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim
# The worker's torch comes from the CPU wheel index: PyPI's default torch pulls CUDA
# libraries (GBs) that a CPU agent never uses. Build with --build-arg TORCH_INDEX_URL=...
# for a CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Or from a directory of wheels inside the build holding torch==TORCH_VERSION (mounted by
# the builder: podman build --volume DIR:/tmp/torch-wheels:ro --build-arg
# TORCH_WHEELS=/tmp/torch-wheels); torch's own dependencies then come from PyPI. Empty (the
# default): TORCH_INDEX_URL as above.
ARG TORCH_WHEELS=

# ---------------------------------------------------------------- base: runtime only
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A base that has the user already (one built on a kvsvc image) keeps it, if it is
# 10001:10001; any other uid fails the build.
RUN (getent group kvsvc >/dev/null || groupadd --system --gid 10001 kvsvc) \
 && (id -u kvsvc >/dev/null 2>&1 || useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin kvsvc) \
 && test "$(id -u kvsvc):$(id -g kvsvc)" = 10001:10001

# ---------------------------------------------------------------- build: the wheel
FROM base AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvsvc ./kvsvc
COPY clients ./clients
# The compiled core (kvsvc.native; the wheel carries kvsvc/_compiled): mypyc from mypy, a
# C compiler for this stage only (the runtime stages need none), in a build venv (a
# Debian python refuses system-wide pip installs). Without a compiler the image's core is
# pure Python, and the build says so.
RUN (command -v cc >/dev/null 2>&1 \
     || (apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null) \
     || echo "notice: no C compiler could be installed") \
 && python -m venv /opt/build \
 && /opt/build/bin/pip install -q --upgrade pip "setuptools>=77" wheel "mypy>=2.4.1" \
 && /opt/build/bin/python -m kvsvc.tools.compile_core \
 && /opt/build/bin/pip wheel --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- server-venv: no torch
FROM base AS server-venv
COPY --from=build /wheels /wheels
RUN python -m venv /opt/kvsvc/venv \
 && /opt/kvsvc/venv/bin/pip install /wheels/kvsvc-*.whl \
 && ! /opt/kvsvc/venv/bin/python -c "import torch" 2>/dev/null

# ---------------------------------------------------------------- worker-venv: + torch
# torch goes in before the kvsvc wheel is copied: that layer (~750 MB) stays cached when
# only kvsvc's sources change. A TORCH_WHEELS directory must hold the wheel (--no-index
# fails loudly rather than fetching PyPI's multi-GB CUDA build instead).
FROM base AS worker-venv
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG TORCH_WHEELS
RUN python -m venv /opt/kvsvc/venv \
 && if [ -n "${TORCH_WHEELS}" ]; then \
        /opt/kvsvc/venv/bin/pip install --no-index --no-deps --find-links "${TORCH_WHEELS}" \
            "torch==${TORCH_VERSION}" \
     && /opt/kvsvc/venv/bin/pip install --find-links "${TORCH_WHEELS}" "torch==${TORCH_VERSION}"; \
    else \
        /opt/kvsvc/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi
COPY --from=build /wheels /wheels
RUN /opt/kvsvc/venv/bin/pip install "$(ls /wheels/kvsvc-*.whl)[worker]"

# ---------------------------------------------------------------- worker
FROM base AS worker
COPY --from=worker-venv /opt/kvsvc/venv /opt/kvsvc/venv
ENV PATH=/opt/kvsvc/venv/bin:$PATH
USER 10001:10001
EXPOSE 9401
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "kvsvc.tools.healthcheck", "--agent-metrics", "auto"]
ENTRYPOINT ["kvsvc"]
# A CPU agent for the compose demo; override the arguments for a real deployment.
CMD ["worker", "--server", "server:50051", "--pool", "demo", "--rank", "0", "--world-size", "1", "--device", "cpu", "--model-config", "llama-3.2-1b", "--kv-cache-memory", "256MiB", "--metrics-listen", "0.0.0.0:9401"]

# ---------------------------------------------------------------- server (default)
FROM base AS server
COPY --from=server-venv /opt/kvsvc/venv /opt/kvsvc/venv
# The simulated engine of deploy/compose.yaml and the Kubernetes example (needs only the client).
COPY deploy/demo_engine.py /opt/kvsvc/demo_engine.py
ENV PATH=/opt/kvsvc/venv/bin:$PATH
USER 10001:10001
EXPOSE 50051 9400
# --server auto: the kvsvc serve process of this container (PID 1) on its own --listen
# address, so `docker run kvsvc:server serve --listen 0.0.0.0:6000 ...` is checked on 6000.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-m", "kvsvc.tools.healthcheck", "--server", "auto"]
ENTRYPOINT ["kvsvc"]
CMD ["serve", "--listen", "0.0.0.0:50051", "--metrics-listen", "0.0.0.0:9400", "--pool", "demo", "--world-size", "1", "--max-model-len", "4096"]
