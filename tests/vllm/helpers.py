"""Shared pieces of the vLLM integration tests: a tiny model, real ``kvsvc serve`` processes
and vLLM engines on the CPU.

Everything is a plain function or context manager, so any test module can build its own
fixtures from them::

    from tests.vllm.helpers import kvsvc_server, make_llm, release_llm, write_tiny_model

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory):
        return write_tiny_model(tmp_path_factory.mktemp("tiny"))

    def test_x(model_dir):
        with kvsvc_server() as server:
            llm = make_llm(model_dir, **kvsvc_engine_args(server.address))
            try:
                ...
            finally:
                release_llm(llm)

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
:func:`vllm_test_env`), so a test can reach the engine core and its worker objects. One
engine costs a few seconds and about 1.5 GiB; :func:`release_llm` frees it before the next.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.vllm_on_kvsvc import TINY_LLAMA
from kvsvc.demo.processes import Child, spawn, wait_for_ports

# A 4-layer Llama with 2 KV heads of 64 (float32): 4 x 2 x 2 x 64 x 4 B = 4 KiB per token,
# 128 KiB per 32-token block. Weights are random (load_format="dummy"), no tokenizer.
# The example's model (docs/vllm.md), so the tests run what a newcomer runs.
TINY_LLAMA_CONFIG: dict[str, Any] = TINY_LLAMA

# In-process engine (so tests can inspect it) and no Hub access.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}

POOL = "vllm"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
# A fixed KV budget keeps block counts reproducible (vLLM's CPU profiling subtracts this
# process's resident memory, which grows with every engine a test session built).
KV_CACHE_BYTES = 64 * 1024 * 1024

WORKER_CLS = "kvsvc.integrations.vllm.worker.KvsvcWorker"


def write_tiny_model(directory: Path) -> Path:
    """Write the tiny Llama's ``config.json`` into ``directory``; return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return directory


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block, then restore what was there."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def vllm_test_env() -> AbstractContextManager[None]:
    """Set :data:`VLLM_ENV` for the block (vLLM reads it when an engine starts)."""
    return environment(**VLLM_ENV)


# --------------------------------------------------------------------------- kvsvc server


@dataclass
class KvsvcServer:
    """A running ``kvsvc serve`` child process with one pool."""

    child: Child
    address: str
    pool: str
    frames: str | None = None  # the framed transport's unix:PATH, when it has one

    def client(self) -> Any:
        """An engine-side client of the pool (close it, or use ``with``)."""
        from kvsvc_client import KVCacheClient

        return KVCacheClient(self.address, pool=self.pool)

    def pool_info(self) -> Any:
        """The admin view of the pool (``kvsvc ctl pools``)."""
        with self.client() as client:
            return next(p for p in client.list_pools() if p.name == self.pool)

    def plan(self) -> tuple[dict[str, Any], Any]:
        """``(plan as kvsvc ctl plan --json prints it, GetPlanResponse)``."""
        with self.client() as client:
            response = client.get_plan(self.pool)
        return json.loads(response.plan_json or "{}"), response

    def output(self) -> str:
        return self.child.output()


@contextmanager
def kvsvc_server(
    *extra_args: str,
    pool: str = POOL,
    world_size: int = 1,
    block_size: int | None = BLOCK_SIZE,
    log_level: str = "WARNING",
    frames: bool = False,
    env: dict[str, str] | None = None,
    listen: str = "127.0.0.1:0",
) -> Iterator[KvsvcServer]:
    """Run ``kvsvc serve`` on a free loopback port with one pool; stop it afterwards.

    Args:
        extra_args: more ``kvsvc serve`` flags (``"--num-gpu-blocks-override", "100"``).
        block_size: the pool's ``--block-size`` (None: not given).
        frames: also serve the framed transport on a Unix socket (``server.frames``).
        env: more environment for the server (``KVSVC_PURE_PYTHON=1``: the pure core).
        listen: the gRPC address (a fixed one, from ``tests.tooling.free_port``, for a
            server restarted in place).
    """
    args = [
        "serve",
        "--listen",
        listen,
        "--metrics-listen",
        "off",
        "--log-level",
        log_level,
        "--pool",
        pool,
        "--world-size",
        str(world_size),
    ]
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    with tempfile.TemporaryDirectory(prefix="kvsvc-", dir="/tmp") as sockets:
        frames_address = f"unix:{sockets}/frames.sock" if frames else None
        if frames_address is not None:
            args += ["--frames-listen", frames_address]
        child = spawn(f"kvsvc-{pool}", [*args, *extra_args], env=env)
        try:
            port, _ = wait_for_ports(child)
            yield KvsvcServer(child, f"127.0.0.1:{port}", pool, frames_address)
        finally:
            child.stop()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# --------------------------------------------------------------------------- vLLM engines


def engine_args(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` for the tiny model on the CPU (stock vLLM)."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "enable_prefix_caching": True,
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "seed": 0,
        "gpu_memory_utilization": 0.2,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    args.update(overrides)
    return args


def kvsvc_worker_args(server: str, pool: str = POOL, **settings: Any) -> dict[str, Any]:
    """``worker_cls`` and ``additional_config`` of kvsvc's worker alone (stock scheduler).

    ``settings`` go to the ``kvsvc`` entry (``plan_timeout=3``, ...).
    """
    return {
        "worker_cls": WORKER_CLS,
        "additional_config": {"kvsvc": {"server": server, "pool": pool, **settings}},
    }


def make_llm(model_dir: Path, **overrides: Any) -> Any:
    """Start a ``vllm.LLM`` for the tiny model (see :func:`engine_args`)."""
    import vllm

    with vllm_test_env():
        return vllm.LLM(**engine_args(model_dir, **overrides))


def engine_core(llm: Any) -> Any:
    """The in-process ``EngineCore`` of an ``LLM``."""
    return llm.llm_engine.engine_core.engine_core


def driver_worker(llm: Any) -> Any:
    """The worker object (``KvsvcWorker`` or vLLM's own) of an in-process ``LLM``."""
    return engine_core(llm).model_executor.driver_worker.worker


def release_llm(llm: Any) -> None:
    """Shut an engine down (workers included) and free its memory for the next one."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def cleanup_after_failed_start() -> None:
    """Undo what an engine that failed to start left behind (its distributed state), so
    the next engine of this process can start."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    gc.collect()


def greedy_tokens(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids) of ``prompts``, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    return [list(out.outputs[0].token_ids) for out in outputs]
