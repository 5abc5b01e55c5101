"""What a rank tells the server when it registers: its :class:`Registration` (layer specs,
memory figures, model), the checks a registration must pass before it reaches the pool's
planner, and its saved form (a pool's state on disk holds every rank's registration).

Memory claims are bounded here: no figure above :data:`MAX_MEMORY_BYTES` (per rank), and
none of free, non-KV and KV-cache bytes above the total when a total is given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import InvalidArgument, quoted
from kvsvc.server.config import PoolConfig
from kvsvc.server.persistence.records import RankRecord
from kvsvc.server.seclog import security_log
from kvsvc.specs import AttentionSpec, KVCacheSpec, iter_layer_specs
from kvsvc.specs.serde import spec_from_dict, spec_to_dict

# The most bytes a rank may claim in any memory figure: 2^48 B = 256 TiB, far above any
# device or host, far below what would overflow the planner's arithmetic into nonsense.
MAX_MEMORY_BYTES = 2**48
_MEMORY_FIELDS = ("total_bytes", "free_bytes", "non_kv_bytes", "kv_cache_bytes")
log = logging.getLogger("kvsvc.server")


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """A rank's memory figures, in bytes (0: not reported)."""

    total_bytes: int = 0
    free_bytes: int = 0
    non_kv_bytes: int = 0
    kv_cache_bytes: int = 0


@dataclass(slots=True)
class Registration:
    """What a rank told the server when it registered."""

    rank: int
    world_size: int
    device: str
    hostname: str
    specs: dict[str, KVCacheSpec]
    memory: MemoryReport
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_model_len: int = 0
    max_num_encoder_input_tokens: int = 0
    model: str = ""
    total_num_kv_heads: int = 0
    # The identity of the KV tensors the agent holds from an earlier session ("" if none).
    allocation_id: str = ""
    # The agent runs inside an engine whose workers hold the tensors (vLLM on kvsvc).
    in_engine: bool = False


def check_memory_claims(reg: Registration) -> None:
    """Refuse memory figures no device has, before they reach the planner.

    A claim of 2^50 bytes once made the manager try to build billions of blocks
    (MemoryError, and a pool stuck half-registered).
    """
    mem = reg.memory
    for name in _MEMORY_FIELDS:
        value = getattr(mem, name)
        if not 0 <= value <= MAX_MEMORY_BYTES:
            raise InvalidArgument(
                f"memory.{name}",
                f"rank {reg.rank} claims {value} B, beyond the cap of 2^48 B (256 TiB) per rank",
            )
    if mem.total_bytes:
        for name in ("free_bytes", "non_kv_bytes", "kv_cache_bytes"):
            value = getattr(mem, name)
            if value > mem.total_bytes:
                raise InvalidArgument(
                    f"memory.{name}",
                    f"rank {reg.rank} claims {value} B, more than its memory.total_bytes "
                    f"{mem.total_bytes} B",
                )


def available_bytes(reg: Registration, gpu_memory_utilization: float) -> int:
    """The bytes a rank offers the plan: its KV-cache bytes, or its share of the total.

    Raises:
        InvalidArgument: the figures leave nothing for the KV cache.
    """
    mem = reg.memory
    if mem.kv_cache_bytes > 0:
        return mem.kv_cache_bytes
    if mem.total_bytes > 0:
        available = int(mem.total_bytes * gpu_memory_utilization) - mem.non_kv_bytes
        if available > 0:
            return available
        raise InvalidArgument(
            "memory",
            f"rank {reg.rank}: total {mem.total_bytes} B x gpu_memory_utilization "
            f"{gpu_memory_utilization} leaves nothing after {mem.non_kv_bytes} B "
            "of non-KV memory; raise gpu_memory_utilization or offer kv_cache_bytes",
        )
    raise InvalidArgument(
        "memory", f"rank {reg.rank}: report kv_cache_bytes or total_bytes (both are 0)"
    )


def check_registration(
    config: PoolConfig, reg: Registration, registered: Iterable[Registration]
) -> None:
    """Refuse a registration that does not fit the pool's config or disagrees with the
    ranks ``registered`` already (their layer specs, lengths and parallelism).

    Raises:
        InvalidArgument: naming the field.
    """
    if reg.world_size != config.world_size:
        raise InvalidArgument(
            "world_size",
            f"pool {quoted(config.name)} has world size {config.world_size}, "
            f"the agent says {reg.world_size}",
        )
    if not 0 <= reg.rank < config.world_size:
        raise InvalidArgument(
            "rank",
            f"{reg.rank} is outside [0, {config.world_size}) for pool {quoted(config.name)}",
        )
    block_size = config.block_size
    if block_size is not None:
        for name, spec in reg.specs.items():
            for inner in iter_layer_specs(spec):
                if isinstance(inner, AttentionSpec) and inner.block_size % block_size:
                    raise InvalidArgument(
                        "layers",
                        f"layer {name} has block size {inner.block_size}, not a multiple of "
                        f"pool {quoted(config.name)}'s block size {block_size}",
                    )
    for theirs in registered:
        if theirs.rank == reg.rank:
            continue
        for name, spec in reg.specs.items():
            if name in theirs.specs and theirs.specs[name] != spec:
                raise InvalidArgument(
                    "layers",
                    f"layer {name} of rank {reg.rank} has spec {spec!r}, but rank "
                    f"{theirs.rank} registered {theirs.specs[name]!r}; every rank must "
                    "report the same spec for a layer",
                )
        for attr, what in (
            ("max_model_len", "max_model_len"),
            ("max_num_encoder_input_tokens", "max_num_encoder_input_tokens"),
            ("tensor_parallel_size", "tensor_parallel_size"),
            ("pipeline_parallel_size", "pipeline_parallel_size"),
            ("total_num_kv_heads", "total_num_kv_heads"),
        ):
            if getattr(theirs, attr) != getattr(reg, attr):
                raise InvalidArgument(
                    what,
                    f"rank {reg.rank} says {getattr(reg, attr)} but rank {theirs.rank} "
                    f"said {getattr(theirs, attr)}",
                )


def check_replacement(
    config: PoolConfig,
    old: Registration,
    reg: Registration,
    available: int,
    needed: int,
    replan_hint: str,
) -> None:
    """Refuse a rank of a planned pool that comes back with other layer specs than the
    ones the pool was planned for (``replan_hint`` says how to plan anew), or offering
    fewer bytes than its plan ``needed``.

    Raises:
        InvalidArgument: naming the layers, or the bytes.
    """
    if old.specs != reg.specs:
        changed = sorted(
            name
            for name in old.specs.keys() | reg.specs.keys()
            if old.specs.get(name) != reg.specs.get(name)
        )
        shown = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise InvalidArgument(
            "layers",
            f"rank {reg.rank} registered different layer specs than the ones pool "
            f"{quoted(config.name)} was planned for (layers {shown}); {replan_hint}",
        )
    if available < needed:
        raise InvalidArgument(
            "memory",
            f"rank {reg.rank} offers {available} B but its plan needs {needed} B",
        )


def registration_to_dict(reg: Registration, available_bytes: int) -> dict[str, Any]:
    """A registration (and the bytes it offered the plan) as JSON-ready values."""
    return {
        "rank": reg.rank,
        "world_size": reg.world_size,
        "device": reg.device,
        "hostname": reg.hostname,
        # A list of [name, spec], not a mapping: states are written with sorted keys, and
        # the layers' order is part of the plan ("model.layers.10" sorts before ".2").
        "specs": [[name, spec_to_dict(spec)] for name, spec in reg.specs.items()],
        "memory": {name: getattr(reg.memory, name) for name in _MEMORY_FIELDS},
        "tensor_parallel_size": reg.tensor_parallel_size,
        "pipeline_parallel_size": reg.pipeline_parallel_size,
        "max_model_len": reg.max_model_len,
        "max_num_encoder_input_tokens": reg.max_num_encoder_input_tokens,
        "model": reg.model,
        "total_num_kv_heads": reg.total_num_kv_heads,
        "in_engine": reg.in_engine,
        "available_bytes": available_bytes,
    }


def _layer_pairs(specs: Any) -> list[tuple[str, Any]]:
    """A saved registration's layers in their order: ``[[name, spec], ...]``."""
    if not isinstance(specs, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) for pair in specs
    ):
        raise TypeError("a registration's specs must be a list of [layer name, spec] pairs")
    return [(name, spec) for name, spec in specs]


def registration_from_dict(data: dict[str, Any]) -> tuple[Registration, int]:
    """The registration :func:`registration_to_dict` wrote, and its offered bytes."""
    return (
        Registration(
            rank=data["rank"],
            world_size=data["world_size"],
            device=data["device"],
            hostname=data["hostname"],
            specs={
                name: spec_from_dict(spec, where=f"layer {name}")
                for name, spec in _layer_pairs(data["specs"])
            },
            memory=MemoryReport(**data["memory"]),
            tensor_parallel_size=data["tensor_parallel_size"],
            pipeline_parallel_size=data["pipeline_parallel_size"],
            max_model_len=data["max_model_len"],
            max_num_encoder_input_tokens=data["max_num_encoder_input_tokens"],
            model=data["model"],
            total_num_kv_heads=data["total_num_kv_heads"],
            in_engine=bool(data.get("in_engine", False)),  # absent in older states
        ),
        data["available_bytes"],
    )


def rank_record(
    reg: Registration, available_bytes: int, allocated: bool, allocation_id: str
) -> RankRecord:
    """A rank as the pool's state keeps it: its registration, the bytes it offered, and
    whether (and with which tensors) it allocated its plan."""
    return RankRecord(
        reg.rank,
        {**registration_to_dict(reg, available_bytes), "allocated": allocated},
        allocation_id,
    )


def log_rank_back(
    pool: str, reg: Registration, takeover: bool, lost: bool, allocated: bool
) -> None:
    """Say that a rank of ``pool`` is back. Another agent taking a rank this server saw
    (``takeover``), its tensors not the ones the rank had, is a security event. A rank
    back with the tensors it had (an agent that reconnected, or the first registration
    after a restart of the server) is routine: the ordinary log, at INFO; one back after
    a restart with fresh tensors (``lost``) lost its KV data: a warning, not a security
    event."""
    args = (pool, reg.rank, reg.device, reg.hostname or "?")
    if lost:
        how = "; it holds fresh tensors: its KV data is gone"
        say = security_log.warning if takeover else log.warning
    else:
        how = ", with the tensors it had" if allocated else ""
        say = security_log.warning if takeover and not allocated else log.info
    say("pool %s: rank %d is back (%s on %s)%s", *args, how)
