"""How vLLM is pointed at kvsvc: one dict of engine arguments, read back on both sides.

``vllm_kwargs`` is the whole user-facing switch. It names kvsvc's scheduler and worker
classes by import path (vLLM may build them in a spawned engine-core or worker process, so
classes travel as strings) and carries the server address in vLLM's ``additional_config``,
which vLLM hands unchanged to every scheduler and worker it builds. This module does not
import vLLM, so the CLI can print the flags on a machine without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SCHEDULER_CLS = "kvsvc.integrations.vllm.scheduler.KvsvcScheduler"
WORKER_CLS = "kvsvc.integrations.vllm.worker.KvsvcWorker"
# The key of vLLM's ``additional_config`` that holds kvsvc's settings.
CONFIG_KEY = "kvsvc"


@dataclass(frozen=True)
class KvsvcSettings:
    """Where vLLM's scheduler and workers find their kvsvc pool.

    Attributes:
        server: ``HOST:PORT`` of ``kvsvc serve``.
        pool: the pool this engine owns (one engine per pool: its blocks are this
            engine's KV cache memory).
        auth_token: bearer token of the server, if it requires one.
        rpc_timeout: deadline of each call, in seconds.
        plan_timeout: how long a worker waits for the pool's plan, in seconds.
    """

    server: str
    pool: str
    auth_token: str | None = None
    rpc_timeout: float = 30.0
    plan_timeout: float = 300.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"server": self.server, "pool": self.pool}
        if self.auth_token is not None:
            out["auth_token"] = self.auth_token
        if self.rpc_timeout != KvsvcSettings.rpc_timeout:
            out["rpc_timeout"] = self.rpc_timeout
        if self.plan_timeout != KvsvcSettings.plan_timeout:
            out["plan_timeout"] = self.plan_timeout
        return out


def vllm_kwargs(server: str, pool: str, auth_token: str | None = None) -> dict[str, Any]:
    """Keyword arguments that make ``vllm.LLM(model=..., **vllm_kwargs(...))`` run on kvsvc.

    The scheduler's KV cache manager becomes a client of the pool (blocks, prefix index,
    hashing and eviction live in the server) and each worker registers its layer specs and
    profiled memory with the pool and allocates the block count the pool planned.

    Args:
        server: ``HOST:PORT`` of ``kvsvc serve``.
        pool: pool name (``kvsvc serve --pool NAME``).
        auth_token: the server's bearer token; None reads ``KVSVC_AUTH_TOKEN`` at start.

    Returns:
        ``scheduler_cls``, ``worker_cls`` and ``additional_config``.

    Raises:
        ValueError: an empty server address or pool name.
    """
    settings = make_settings(server, pool, auth_token)
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "additional_config": {CONFIG_KEY: settings.to_dict()},
    }


def make_settings(server: str, pool: str, auth_token: str | None = None) -> KvsvcSettings:
    """Checked settings (the one constructor every entry point goes through)."""
    if not server or ":" not in server:
        raise ValueError(f"server must be HOST:PORT, got {server!r}")
    if not pool:
        raise ValueError("pool must not be empty")
    return KvsvcSettings(server=server, pool=pool, auth_token=auth_token or None)


def vllm_serve_flags(server: str, pool: str) -> list[str]:
    """``vllm serve`` flags equivalent to :func:`vllm_kwargs` (the token stays in the env)."""
    settings = make_settings(server, pool)
    return [
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--worker-cls",
        WORKER_CLS,
        "--additional-config",
        json.dumps({CONFIG_KEY: settings.to_dict()}, separators=(",", ":")),
    ]


def settings_from_additional_config(additional_config: Any) -> KvsvcSettings:
    """The settings vLLM carried to a scheduler or worker (``vllm_config.additional_config``).

    Raises:
        ValueError: kvsvc's classes were configured without ``vllm_kwargs``' settings.
    """
    raw = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    if not isinstance(raw, dict):
        raise ValueError(
            f"vLLM runs kvsvc's classes but additional_config has no {CONFIG_KEY!r} entry: "
            "build the engine arguments with kvsvc.integrations.vllm.vllm_kwargs(server, pool) "
            "or `kvsvc vllm-args`"
        )
    # No token in the config: each side reads its role's from the environment at start
    # (KVSVC_ENGINE_TOKEN for the scheduler, KVSVC_AGENT_TOKEN for the workers, either
    # falling back to KVSVC_AUTH_TOKEN; see kvsvc_client.resolve_token).
    token = raw.get("auth_token") or None
    settings = make_settings(str(raw.get("server", "")), str(raw.get("pool", "")), token)
    return KvsvcSettings(
        server=settings.server,
        pool=settings.pool,
        auth_token=settings.auth_token,
        rpc_timeout=float(raw.get("rpc_timeout", KvsvcSettings.rpc_timeout)),
        plan_timeout=float(raw.get("plan_timeout", KvsvcSettings.plan_timeout)),
    )
