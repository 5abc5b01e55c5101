"""How vLLM is pointed at kvsvc: one dict of engine arguments, read back on both sides.

``vllm_kwargs`` is the whole user-facing switch. It names kvsvc's scheduler and worker
classes by import path (vLLM may build them in a spawned engine-core or worker process, so
classes travel as strings) and carries the server address in vLLM's ``additional_config``,
which vLLM hands unchanged to every scheduler and worker it builds. This module does not
import vLLM, so the CLI can print the flags on a machine without it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import string
from dataclasses import dataclass
from typing import Any

from kvsvc_client import STEP_SENDERS

SCHEDULER_CLS = "kvsvc.integrations.vllm.scheduler.KvsvcScheduler"
WORKER_CLS = "kvsvc.integrations.vllm.worker.KvsvcWorker"
# The key of vLLM's ``additional_config`` that holds kvsvc's settings.
CONFIG_KEY = "kvsvc"
# additional_config keys of the channel's TLS (KvsvcSettings' fields of the same names).
TLS_KEYS = ("tls_ca", "tls_cert", "tls_key", "tls_server_name")
# The most scheduling steps whose operations one Step may carry (KvsvcSettings.steps_per_call).
MAX_STEPS_PER_CALL = 16
# KvsvcSettings' timeouts (seconds), as additional_config and make_settings name them.
TIMEOUT_KEYS = ("rpc_timeout", "unavailable_timeout", "plan_timeout")
# The longest any of KvsvcSettings' timeouts may be, in seconds (a day): past it a typo,
# not a wait anyone means (and gRPC's deadline arithmetic has limits of its own).
MAX_TIMEOUT_S = 86_400.0


@dataclass(frozen=True)
class KvsvcSettings:
    """Where vLLM's scheduler and workers find their kvsvc pool.

    Attributes:
        server: ``HOST:PORT`` of ``kvsvc serve`` (or ``unix:PATH`` of its ``--listen``).
        pool: the pool this engine owns (one engine per pool: its blocks are this
            engine's KV cache memory).
        auth_token: bearer token of the server, if it requires one.
        rpc_timeout: deadline of each call, in seconds (more than 0, at most
            :data:`MAX_TIMEOUT_S`).
        unavailable_timeout: how long, in seconds, the scheduler's calls keep being retried
            while the server cannot be reached (it restarts on its state directory, and
            the pool goes on where it was) before the engine's step fails naming the
            server (0 to :data:`MAX_TIMEOUT_S`; 0: the client's few quick retries only).
        plan_timeout: how long a worker waits for the pool's plan, in seconds (more than
            0, at most :data:`MAX_TIMEOUT_S`).
        tls_ca / tls_cert / tls_key / tls_server_name: TLS to the server (paths on the
            machine vLLM runs on), as :class:`kvsvc_client.ClientOptions` takes them; None
            reads ``KVSVC_TLS_CA`` / ``KVSVC_TLS_CERT`` / ``KVSVC_TLS_KEY`` /
            ``KVSVC_TLS_SERVER_NAME`` in the scheduler's and each worker's process.
        frames: the server's framed transport (``unix:PATH`` or ``HOST:PORT`` of its
            ``--frames-listen``) for the scheduler's calls, every scheduling step's: the
            same calls without gRPC's per-call work. The workers (registration, the plan
            stream) still use ``server``. None: everything over ``server``.
        allow_untested_vllm: run on a vLLM release outside the range kvsvc proves
            (:data:`kvsvc.integrations.vllm.compat.SUPPORTED`), with a warning, instead
            of refusing to start.
        step_sender: how the scheduler's Step goes out while the forward pass runs
            (:class:`kvsvc_client.ClientOptions`' ``step_sender``): ``thread`` (the
            client's sender thread) or ``inline`` (``frames`` only: written and read on
            the scheduler's thread, no thread hand-offs; a little less CPU in all, more
            on the scheduler's thread).
        steps_per_call: how many scheduling steps' operations at most go to the server in
            one Step (1 to :data:`MAX_STEPS_PER_CALL`; 1, the default: every step's own).
            The engine never waits on the server's answer (its replica gives it), so a
            step's operations may wait for the next steps' and go with them: fewer calls,
            and fewer of the server's and the sender thread's wake-ups, whose cost a
            call pays whatever it carries (on an engine whose forward pass takes every
            core, that CPU is the forward pass's). The price is the server's view of the
            pool (its prefix index, the KV events routers read, its metrics) lagging the
            engine by up to ``steps_per_call - 1`` steps, and a reply the replica did not
            predict noticed as much later. A step that admits a request sends at once
            (with what waited), as does an engine going idle, a reset of the prefix cache,
            a resync and shutdown: what is held is decodes, frees and outputs of a few
            steps, never an admission.
    """

    server: str
    pool: str
    auth_token: str | None = None
    rpc_timeout: float = 30.0
    unavailable_timeout: float = 30.0
    plan_timeout: float = 300.0
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    frames: str | None = None
    allow_untested_vllm: bool = False
    step_sender: str = "thread"
    steps_per_call: int = 1

    @property
    def engine_target(self) -> str:
        """The client target of the scheduler's calls."""
        return f"frames:{self.frames}" if self.frames else self.server

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"server": self.server, "pool": self.pool}
        if self.frames is not None:
            out["frames"] = self.frames
        if self.auth_token is not None:
            out["auth_token"] = self.auth_token
        for key in TIMEOUT_KEYS:
            if getattr(self, key) != getattr(KvsvcSettings, key):
                out[key] = getattr(self, key)
        for key in TLS_KEYS:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.allow_untested_vllm:
            out["allow_untested_vllm"] = True
        if self.step_sender != KvsvcSettings.step_sender:
            out["step_sender"] = self.step_sender
        if self.steps_per_call != KvsvcSettings.steps_per_call:
            out["steps_per_call"] = self.steps_per_call
        return out


def vllm_kwargs(
    server: str,
    pool: str,
    auth_token: str | None = None,
    *,
    frames: str | None = None,
    allow_untested_vllm: bool = False,
    step_sender: str = KvsvcSettings.step_sender,
    steps_per_call: int = KvsvcSettings.steps_per_call,
    rpc_timeout: float = KvsvcSettings.rpc_timeout,
    unavailable_timeout: float = KvsvcSettings.unavailable_timeout,
    plan_timeout: float = KvsvcSettings.plan_timeout,
    **tls: str | None,
) -> dict[str, Any]:
    """Keyword arguments that make ``vllm.LLM(model=..., **vllm_kwargs(...))`` run on kvsvc.

    The scheduler's KV cache manager becomes a client of the pool (blocks, prefix index,
    hashing and eviction live in the server) and each worker registers its layer specs and
    profiled memory with the pool and allocates the block count the pool planned.

    Args:
        server: ``HOST:PORT`` of ``kvsvc serve``.
        pool: pool name (``kvsvc serve --pool NAME``).
        auth_token: the server's bearer token; None: the scheduler reads
            ``KVSVC_ENGINE_TOKEN`` and each worker ``KVSVC_AGENT_TOKEN`` at start (or their
            ``_FILE`` forms), either falling back to ``KVSVC_AUTH_TOKEN``.
        frames: the scheduler's calls over the server's framed transport at this address
            (``unix:PATH`` or ``HOST:PORT`` of ``kvsvc serve --frames-listen``).
        allow_untested_vllm: start on a vLLM release outside the supported range (with a
            warning) instead of refusing.
        step_sender: ``thread`` or ``inline`` (see :class:`KvsvcSettings`).
        steps_per_call: scheduling steps one Step may carry (see :class:`KvsvcSettings`).
        rpc_timeout / unavailable_timeout / plan_timeout: seconds (see
            :class:`KvsvcSettings`).
        tls: ``tls_ca``, ``tls_cert``, ``tls_key``, ``tls_server_name`` for a server with
            TLS (see :class:`KvsvcSettings`); unset ones come from ``KVSVC_TLS_*``.

    Returns:
        ``scheduler_cls``, ``worker_cls`` and ``additional_config``.

    Raises:
        ValueError: an empty server address or pool name, an unknown TLS key, a client
            certificate without its key, or a ``step_sender``, ``steps_per_call`` or timeout
            out of range.
    """
    settings = dataclasses.replace(
        make_settings(
            server,
            pool,
            auth_token,
            frames=frames,
            step_sender=step_sender,
            steps_per_call=steps_per_call,
            rpc_timeout=rpc_timeout,
            unavailable_timeout=unavailable_timeout,
            plan_timeout=plan_timeout,
            **tls,
        ),
        allow_untested_vllm=allow_untested_vllm,
    )
    return {
        "scheduler_cls": SCHEDULER_CLS,
        "worker_cls": WORKER_CLS,
        "additional_config": {CONFIG_KEY: settings.to_dict()},
    }


def make_settings(
    server: str,
    pool: str,
    auth_token: str | None = None,
    *,
    frames: str | None = None,
    step_sender: str = KvsvcSettings.step_sender,
    steps_per_call: int = KvsvcSettings.steps_per_call,
    rpc_timeout: float = KvsvcSettings.rpc_timeout,
    unavailable_timeout: float = KvsvcSettings.unavailable_timeout,
    plan_timeout: float = KvsvcSettings.plan_timeout,
    **tls: str | None,
) -> KvsvcSettings:
    """Checked settings (the one constructor every entry point goes through)."""
    if not server or ":" not in server:
        raise ValueError(f"server must be HOST:PORT, got {server!r}")
    if frames is not None and (
        not isinstance(frames, str) or ":" not in frames or frames.startswith("frames:")
    ):
        raise ValueError(
            f"frames must be unix:PATH or HOST:PORT (kvsvc serve --frames-listen), got {frames!r}"
        )
    if not pool:
        raise ValueError("pool must not be empty")
    if step_sender not in STEP_SENDERS:
        raise ValueError(
            f"step_sender must be one of {', '.join(STEP_SENDERS)}, got {step_sender!r}"
        )
    if step_sender == "inline" and frames is None:
        raise ValueError(
            "step_sender 'inline' needs frames (the framed transport): over gRPC a Step "
            "is sent by a thread"
        )
    if (
        type(steps_per_call) is not int  # a bool, a float or a string is refused too
        or not 1 <= steps_per_call <= MAX_STEPS_PER_CALL
    ):
        raise ValueError(
            f"steps_per_call must be a whole number from 1 to {MAX_STEPS_PER_CALL}, "
            f"got {steps_per_call!r}"
        )
    _check_seconds("rpc_timeout", rpc_timeout, zero_allowed=False)
    _check_seconds("unavailable_timeout", unavailable_timeout, zero_allowed=True)
    _check_seconds("plan_timeout", plan_timeout, zero_allowed=False)
    unknown = sorted(set(tls) - set(TLS_KEYS))
    if unknown:
        raise ValueError(
            f"unknown TLS setting(s) {', '.join(unknown)}; valid: {', '.join(TLS_KEYS)}"
        )
    for key, value in tls.items():
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{key} must be a file path (or a name), got {value!r}")
    if (tls.get("tls_cert") is None) != (tls.get("tls_key") is None):
        raise ValueError("tls_cert and tls_key go together: the client certificate and its key")
    return KvsvcSettings(
        server=server,
        pool=pool,
        auth_token=auth_token or None,
        tls_ca=tls.get("tls_ca"),
        tls_cert=tls.get("tls_cert"),
        tls_key=tls.get("tls_key"),
        tls_server_name=tls.get("tls_server_name"),
        frames=frames,
        step_sender=step_sender,
        steps_per_call=steps_per_call,
        rpc_timeout=float(rpc_timeout),
        unavailable_timeout=float(unavailable_timeout),
        plan_timeout=float(plan_timeout),
    )


def _check_seconds(name: str, value: object, *, zero_allowed: bool) -> None:
    """Refuse a timeout that is not a number of seconds in range, naming the setting: a
    JSON string or a bool from ``additional_config`` is refused, not converted."""
    in_range = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if zero_allowed else value > 0)
        and value <= MAX_TIMEOUT_S
    )
    if not in_range:
        bounds = "from 0 to" if zero_allowed else "greater than 0 and at most"
        raise ValueError(
            f"{name} must be a number of seconds {bounds} {MAX_TIMEOUT_S:g}, got {value!r}"
        )


# Characters a word may hold and still reach a program unchanged from an unquoted
# ``$(...)``: none splits a word (IFS) or makes it a glob pattern (``*?[``, extglob's
# ``@+!()``). Quotes and braces are inert there: quote removal and brace expansion apply
# to what was typed, not to what an expansion produced.
_INERT_IN_STRINGS = frozenset(string.ascii_letters + string.digits + "._-:/=,%{}")


def shell_inert_json(value: Any) -> str:
    """``value`` as compact JSON that passes through unquoted command substitution as is.

    The result of ``$(...)`` is split into words and each word globbed, but no quotes are
    removed: a JSON word survives if it has no whitespace and no glob character. Every
    character of a string outside :data:`_INERT_IN_STRINGS` (a space or ``[`` in a path,
    ``*``, a quote, ...) is written as its ``\\uXXXX`` escape, which every JSON parser
    reads back as the character.

    Raises:
        ValueError: ``value`` holds a list (its brackets cannot be escaped) or something
            that is not a JSON object, string, number, boolean or null.
    """
    if isinstance(value, dict):
        items = (f"{shell_inert_json(str(k))}:{shell_inert_json(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, str):
        # UTF-16 code units, so a character past U+FFFF becomes its surrogate pair.
        units = value.encode("utf-16-be")
        chars = (
            units[i : i + 2].decode("utf-16-be", "surrogatepass") for i in range(0, len(units), 2)
        )
        return (
            '"' + "".join(c if c in _INERT_IN_STRINGS else f"\\u{ord(c):04x}" for c in chars) + '"'
        )
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    raise ValueError(f"cannot write {value!r} as one shell word (objects and scalars only)")


def vllm_serve_flags(
    server: str,
    pool: str,
    *,
    frames: str | None = None,
    allow_untested_vllm: bool = False,
    step_sender: str = KvsvcSettings.step_sender,
    steps_per_call: int = KvsvcSettings.steps_per_call,
    rpc_timeout: float = KvsvcSettings.rpc_timeout,
    unavailable_timeout: float = KvsvcSettings.unavailable_timeout,
    plan_timeout: float = KvsvcSettings.plan_timeout,
    **tls: str | None,
) -> list[str]:
    """``vllm serve`` flags equivalent to :func:`vllm_kwargs` (the token stays in the env;
    TLS paths are no secret and may go in, or come from ``KVSVC_TLS_*``).

    Each flag is one word that an unquoted ``$(kvsvc vllm-args ...)`` hands to vLLM
    unchanged (no whitespace, no glob or quote character to remove): the settings go as
    ``--additional-config=JSON`` in :func:`shell_inert_json`'s form.
    """
    settings = dataclasses.replace(
        make_settings(
            server,
            pool,
            frames=frames,
            step_sender=step_sender,
            steps_per_call=steps_per_call,
            rpc_timeout=rpc_timeout,
            unavailable_timeout=unavailable_timeout,
            plan_timeout=plan_timeout,
            **tls,
        ),
        allow_untested_vllm=allow_untested_vllm,
    )
    return [
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--worker-cls",
        WORKER_CLS,
        "--additional-config=" + shell_inert_json({CONFIG_KEY: settings.to_dict()}),
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
    tls = {key: raw[key] for key in TLS_KEYS if raw.get(key) is not None}
    frames = raw.get("frames")
    settings = make_settings(
        str(raw.get("server", "")),
        str(raw.get("pool", "")),
        token,
        frames=frames,
        step_sender=raw.get("step_sender", KvsvcSettings.step_sender),
        steps_per_call=raw.get("steps_per_call", KvsvcSettings.steps_per_call),
        **{key: raw.get(key, getattr(KvsvcSettings, key)) for key in TIMEOUT_KEYS},
        **tls,
    )
    return dataclasses.replace(settings, allow_untested_vllm=raw.get("allow_untested_vllm") is True)
