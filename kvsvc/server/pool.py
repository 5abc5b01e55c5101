"""A pool's lifecycle on the server: ranks register, the pool is planned, ranks allocate.

::

    WAITING_FOR_WORKERS --(all W ranks registered, plan ok)--> PLANNED
    PLANNED --(all ranks reported their allocation)--> READY
    READY <--(a rank lost its plan stream or missed heartbeats / is back)--> DEGRADED

Engine calls are served in READY and DEGRADED. Planning failure (specs disagree, memory
too small, a plan above ``max_num_blocks``, or anything else that goes wrong while the plan
and the manager are built) drops every registration of the pool — nothing stays
half-planned — and records the error for ``GetPlan`` and every rank's plan stream.

Memory claims are bounded at registration: no figure above :data:`MAX_MEMORY_BYTES` (per
rank), and none of free, non-KV and KV-cache bytes above the total when a total is given.

A rank is *live* while its WatchPlan stream is open (or, just after registering, until
its first stream opens). Registering a rank that is live is refused; registering a rank
that is not (its agent died) replaces it and gets the same plan back when its specs match.

Concurrency: the pool runs on the server's event loop. Work is done synchronously between
awaits, so each change is atomic; the few calls heavy enough to offload (planning, very
large steps) run in a thread while holding ``lock``, which every engine call also takes,
so a pool always has one writer at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import json
import logging
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from kvsvc import __version__
from kvsvc.core.state import encode_state
from kvsvc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvsvcError,
    NotFound,
    PlanningError,
    Unavailable,
    quoted,
)
from kvsvc.server.calls import CallLog, parse_journaled, replay_call
from kvsvc.server.config import PoolConfig
from kvsvc.server.events import EventLog
from kvsvc.server.persistence.journal_store import PoolStore
from kvsvc.server.persistence.records import (
    JournalKind,
    JournalRecord,
    RankRecord,
    Snapshot,
    SnapshotCapture,
    StateError,
    new_store_id,
    reply_digest,
)
from kvsvc.server.persistence.snapshot_file import write_snapshot
from kvsvc.server.persistence.writer import DEFAULT_SNAPSHOT_EVERY, PoolPersistence
from kvsvc.server.seclog import security_log
from kvsvc.specs import AttentionSpec, KVCacheSpec, iter_layer_specs
from kvsvc.specs.serde import spec_from_dict, spec_to_dict

log = logging.getLogger("kvsvc.server")

# The most bytes a rank may claim in any memory figure: 2^48 B = 256 TiB, far above any
# device or host, far below what would overflow the planner's arithmetic into nonsense.
MAX_MEMORY_BYTES = 2**48
_MEMORY_FIELDS = ("total_bytes", "free_bytes", "non_kv_bytes", "kv_cache_bytes")


def plan_digest(plan: Any) -> str:
    """A digest of a plan (its ``kvsvc plan --json`` form): a saved state is loaded only
    into the plan it was made for."""
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _same_secret(expected: str, given: str) -> bool:
    """Constant-time comparison (bytes: a non-ASCII string from a client is just wrong)."""
    return hmac.compare_digest(expected.encode(), given.encode())


class PoolState(IntEnum):
    """Matches kvsvc.v1.PoolState."""

    WAITING_FOR_WORKERS = 1
    PLANNED = 2
    READY = 3
    DEGRADED = 4


@dataclass(frozen=True, slots=True)
class MemoryReport:
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
        ),
        data["available_bytes"],
    )


# Pool settings a saved state was planned with: another value means another plan, so a
# restart with it is refused (the others may change between restarts).
# max_pool_tokens's default: this many times the pool's KV capacity in tokens, or this many
# requests of max_model_len (vLLM's default max_num_seqs), whichever is larger.
DEFAULT_POOL_TOKENS_PER_CAPACITY = 4
DEFAULT_POOL_TOKENS_PER_MODEL_LEN = 256
# max_unscheduled_tokens's default: the pool's KV capacity in tokens, or this many prompts
# of max_model_len waiting for their chunks, whichever is larger.
DEFAULT_UNSCHEDULED_TOKENS_PER_MODEL_LEN = 16

PLAN_SETTINGS = (
    "world_size",
    "block_size",
    "max_model_len",
    "hash_algo",
    "enable_prefix_caching",
    "num_gpu_blocks_override",
    "max_num_batched_tokens",
    "disable_hybrid_kv_cache_manager",
    "layout",
)


@dataclass(slots=True)
class RankMemory:
    """What the pool knows of a rank's KV tensors: whether it allocated its plan, and the
    identity it reported for them ("" when it gave none: then a new agent cannot be told
    from a reconnecting one, and is taken to be new)."""

    allocated: bool = False
    allocation_id: str = ""


@dataclass(slots=True)
class RankSlot:
    registration: Registration
    session_id: str
    registered_at: float
    last_seen: float
    available_bytes: int
    allocation_id: str = ""
    open_streams: int = 0
    ever_streamed: bool = False
    allocated: bool = False
    allocated_bytes: int = 0
    memory_free_bytes: int = 0
    views: list[Any] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.registration.rank


@dataclass(slots=True)
class EngineCounters:
    """Engine-call outcomes, plain ints so the hot path pays one add; metrics read them."""

    allocate_ok: int = 0
    allocate_no_space: int = 0
    free_requests: int = 0
    preempt_requests: int = 0
    freed_blocks: int = 0
    lookups: int = 0
    lookup_hit_tokens: int = 0
    steps: int = 0
    step_operations: int = 0


@dataclass(frozen=True, slots=True)
class PlanSnapshot:
    """What a rank's plan stream shows at one moment."""

    state: PoolState
    config: Any | None  # KVCacheConfig of this rank once planned
    error: str
    max_model_len: int


class Pool:
    """Server-side state of one pool. See the module docstring for the lifecycle."""

    def __init__(
        self,
        config: PoolConfig,
        *,
        event_capacity: int = 10000,
        event_max_events: int = 200_000,
        heartbeat_timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_state_change: Callable[[Pool], None] | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.state = PoolState.WAITING_FOR_WORKERS
        self.error = ""
        self.slots: dict[int, RankSlot] = {}
        self.plan: Any | None = None  # kvsvc.planner.KVCachePlan
        self.cache: Any | None = None  # kvsvc.core.PoolKVCache
        self.events = EventLog(event_capacity, event_max_events)
        self.lock = asyncio.Lock()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._changed = asyncio.Event()
        self._on_state_change = on_state_change
        self._planning = False
        # Sessions a failed plan dropped -> the error, so their plan streams can say why.
        self._dropped_sessions: dict[str, str] = {}
        # Counters the metrics module reads.
        self.num_registrations = 0
        self.num_allocation_reports = 0
        self.num_plan_failures = 0
        self.hash_seed: str | None = config.hash_seed
        self.counters = EngineCounters()
        # Called with each Step's operation count (the metrics module's histogram).
        self.step_size_observer: Callable[[int], None] | None = None
        # Replies of recent calls by call_id (a retry answers the first attempt's reply).
        self.calls = CallLog()
        # What the pool's state is made for (set once planned or restored), and where it
        # is kept (see configure_state).
        self.identity: dict[str, Any] | None = None
        self.state_dir: Path | None = None
        self.state_options: dict[str, Any] = {}
        self.persistence: PoolPersistence | None = None
        # Restored from a saved state: engine calls wait (UNAVAILABLE) until every rank is
        # back and has confirmed (or lost) its tensors.
        self.restored = False
        self._restored: dict[int, tuple[Registration, int]] = {}
        self.rank_memory: dict[int, RankMemory] = {}
        self._rank_records: dict[int, RankRecord] = {}
        self._snapshot_task: asyncio.Task[bool] | None = None
        self.num_invalidations = 0

    @property
    def model_name(self) -> str:
        return next((s.registration.model for s in self.slots.values() if s.registration.model), "")

    # ---------------------------------------------------------------- lifecycle

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if self._on_state_change is not None:
            self._on_state_change(self)

    def _set_state(self, state: PoolState) -> None:
        if state != self.state:
            previous, self.state = self.state, state
            if state in (PoolState.READY, PoolState.DEGRADED) or previous in (
                PoolState.READY,
                PoolState.DEGRADED,
            ):
                # Operations, not security: the ordinary log (kvsvc.security is for
                # refusals and takeovers).
                say = log.warning if state != PoolState.READY else log.info
                say("pool %s: %s -> %s%s", self.name, previous.name, state.name, self._why())
            self._notify()

    def _why(self) -> str:
        """Which ranks keep the pool from READY (for the transition's log line)."""
        now = self._clock()
        missing = [r for r in range(self.config.world_size) if r not in self.slots]
        unhealthy = [
            r for r, slot in sorted(self.slots.items()) if not self._rank_healthy(slot, now)
        ]
        parts = []
        if missing:
            parts.append(f"ranks not registered: {missing}")
        if unhealthy:
            parts.append(f"ranks without a plan stream or heartbeat: {unhealthy}")
        return f" ({'; '.join(parts)})" if parts else ""

    def is_live(self, slot: RankSlot, now: float) -> bool:
        if slot.open_streams > 0:
            return True
        # Registered but its plan stream not opened yet: give it the heartbeat timeout.
        return not slot.ever_streamed and now - slot.registered_at < self.heartbeat_timeout_s

    @staticmethod
    def _check_memory_claims(reg: Registration) -> None:
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
                    f"rank {reg.rank} claims {value} B, beyond the cap of 2^48 B (256 TiB) "
                    "per rank",
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

    def _available_bytes(self, reg: Registration) -> int:
        mem = reg.memory
        if mem.kv_cache_bytes > 0:
            return mem.kv_cache_bytes
        if mem.total_bytes > 0:
            available = int(mem.total_bytes * self.config.gpu_memory_utilization) - mem.non_kv_bytes
            if available > 0:
                return available
            raise InvalidArgument(
                "memory",
                f"rank {reg.rank}: total {mem.total_bytes} B x gpu_memory_utilization "
                f"{self.config.gpu_memory_utilization} leaves nothing after {mem.non_kv_bytes} B "
                "of non-KV memory; raise gpu_memory_utilization or offer kv_cache_bytes",
            )
        raise InvalidArgument(
            "memory", f"rank {reg.rank}: report kv_cache_bytes or total_bytes (both are 0)"
        )

    def _validate_registration(self, reg: Registration) -> None:
        if reg.world_size != self.config.world_size:
            raise InvalidArgument(
                "world_size",
                f"pool {quoted(self.name)} has world size {self.config.world_size}, "
                f"the agent says {reg.world_size}",
            )
        if not 0 <= reg.rank < self.config.world_size:
            raise InvalidArgument(
                "rank",
                f"{reg.rank} is outside [0, {self.config.world_size}) for pool {quoted(self.name)}",
            )
        block_size = self.config.block_size
        if block_size is not None:
            for name, spec in reg.specs.items():
                for inner in iter_layer_specs(spec):
                    if isinstance(inner, AttentionSpec) and inner.block_size % block_size:
                        raise InvalidArgument(
                            "layers",
                            f"layer {name} has block size {inner.block_size}, not a multiple of "
                            f"pool {quoted(self.name)}'s block size {block_size}",
                        )
        for other in self.slots.values():
            if other.rank == reg.rank:
                continue
            theirs = other.registration
            for name, spec in reg.specs.items():
                if name in theirs.specs and theirs.specs[name] != spec:
                    raise InvalidArgument(
                        "layers",
                        f"layer {name} of rank {reg.rank} has spec {spec!r}, but rank "
                        f"{other.rank} registered {theirs.specs[name]!r}; every rank must "
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
                        f"rank {reg.rank} says {getattr(reg, attr)} but rank {other.rank} "
                        f"said {getattr(theirs, attr)}",
                    )

    async def register(self, reg: Registration) -> RankSlot:
        """Register (or replace) a rank; plan the pool when every rank is in.

        Raises:
            InvalidArgument: bad rank/world size/specs/memory (nothing recorded).
            AlreadyExists: a live agent holds this rank.
        """
        async with self.lock:
            now = self._clock()
            self._validate_registration(reg)
            self._check_memory_claims(reg)
            available = self._available_bytes(reg)
            existing = self.slots.get(reg.rank)
            if existing is not None and self.is_live(existing, now):
                security_log.warning(
                    "pool %s: refused a registration of rank %d from %s (%s): the rank is "
                    "held by a live agent on %s",
                    self.name,
                    reg.rank,
                    reg.hostname or "?",
                    reg.device,
                    existing.registration.hostname or "?",
                )
                raise AlreadyExists(
                    f"rank {reg.rank} of pool {quoted(self.name)} is held by a live agent on "
                    f"{existing.registration.hostname or '?'} ({existing.registration.device}); "
                    "stop it first"
                )
            previous = existing.registration if existing is not None else None
            if previous is None and reg.rank in self._restored:
                previous = self._restored[reg.rank][0]
            if previous is not None and self.plan is not None:
                self._check_replacement(previous, reg, available)
            slot = RankSlot(
                registration=reg,
                # A secret: the rank's later calls must carry it (compared in constant time).
                session_id=secrets.token_hex(16),
                registered_at=now,
                last_seen=now,
                available_bytes=available,
                allocation_id=reg.allocation_id,
            )
            self.slots[reg.rank] = slot
            self.num_registrations += 1
            ticket = 0
            if self.plan is not None:
                memory = self.rank_memory.get(reg.rank, RankMemory())
                # The rank's KV data survives only when the same tensors come back (an
                # agent that reconnects, or a server restart); a new agent's memory is
                # fresh: cached blocks would be read from bytes it no longer has.
                lost = memory.allocated and (
                    not reg.allocation_id or reg.allocation_id != memory.allocation_id
                )
                if existing is not None or reg.rank in self._restored:
                    security_log.warning(
                        "pool %s: rank %d is back (%s on %s)%s",
                        self.name,
                        reg.rank,
                        reg.device,
                        reg.hostname or "?",
                        "; it holds fresh tensors: its KV data is gone"
                        if lost
                        else (", with the tensors it had" if memory.allocated else ""),
                    )
                if lost:
                    ticket = self.invalidate(f"rank {reg.rank} came back with fresh tensors")
                    memory = RankMemory()
                self.rank_memory[reg.rank] = memory
                ticket = max(ticket, self._persist_rank(slot))
                if self.state == PoolState.READY:
                    self._set_state(PoolState.DEGRADED)
                self._notify()
            elif len(self.slots) == self.config.world_size:
                await self._plan_locked()
            else:
                self.error = ""
                self._notify()
        await self.durable(ticket)
        return slot

    def _check_replacement(self, old: Registration, reg: Registration, available: int) -> None:
        if old.specs != reg.specs:
            changed = sorted(
                name
                for name in old.specs.keys() | reg.specs.keys()
                if old.specs.get(name) != reg.specs.get(name)
            )
            shown = ", ".join(changed[:3]) + (
                f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            )
            where = (
                f"; its saved state in {self.state_dir} holds live requests and cached blocks "
                "of that plan: to plan anew, stop the server and move "
                f"{PoolStore.path_for(self.state_dir, self.name)} away (they are lost then)"
                if self.persistence is not None and self.state_dir is not None
                else "; restart the pool to plan anew"
            )
            raise InvalidArgument(
                "layers",
                f"rank {reg.rank} registered different layer specs than the ones pool "
                f"{quoted(self.name)} was planned for (layers {shown}){where}",
            )
        assert self.plan is not None
        needed = self.planned_bytes(reg.rank)
        if available < needed:
            raise InvalidArgument(
                "memory",
                f"rank {reg.rank} offers {available} B but its plan needs {needed} B",
            )

    def planned_bytes(self, rank: int) -> int:
        assert self.plan is not None
        config = self.plan.worker_configs[rank]
        packed = {t.size for t in config.kv_cache_tensors if t.block_stride}
        return sum(t.size for t in config.kv_cache_tensors if not t.block_stride) + sum(packed)

    def _planner_options(self, regs: list[Registration]) -> Any:
        """The planner's options for these registrations (rank order).

        Raises:
            PlanningError: no max_model_len from the config or the agents.
        """
        from kvsvc.planner import PlannerOptions

        max_model_len = self.config.max_model_len
        if max_model_len is None:
            max_model_len = regs[0].max_model_len
        if not max_model_len:
            raise PlanningError(
                f"pool {quoted(self.name)} has no max_model_len: set it in the pool config "
                "(or -1 to fit memory), or have the agents report the model's length"
            )
        return PlannerOptions(
            max_model_len=max_model_len,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_encoder_input_tokens=regs[0].max_num_encoder_input_tokens,
            num_gpu_blocks_override=self.config.num_gpu_blocks_override,
            disable_hybrid_kv_cache_manager=self.config.disable_hybrid_kv_cache_manager,
            enable_prefix_caching=self.config.enable_prefix_caching,
            layout=self.config.layout,
            tensor_parallel_size=max(1, regs[0].tensor_parallel_size),
            # Auto-fit searches up to the model's own limit when the agents know it.
            derived_max_model_len=regs[0].max_model_len or None,
            total_num_kv_heads=regs[0].total_num_kv_heads or None,
        )

    async def _plan_locked(self) -> None:
        from kvsvc.planner import plan_kv_cache

        regs = [self.slots[r].registration for r in range(self.config.world_size)]
        memory = [self.slots[r].available_bytes for r in range(self.config.world_size)]
        loop = asyncio.get_running_loop()
        try:
            options = self._planner_options(regs)
            specs = [reg.specs for reg in regs]
            self._planning = True
            try:
                plan = await loop.run_in_executor(None, plan_kv_cache, specs, memory, options)
                self._check_num_blocks(plan)
                cache = await loop.run_in_executor(None, self._build_cache, plan)
            finally:
                self._planning = False
        except (PlanningError, ValueError) as exc:
            self._plan_failed(str(exc))
            return
        except Exception as exc:  # MemoryError included: never leave the pool half-planned
            log.exception("planning pool %r failed unexpectedly", self.name)
            self._plan_failed(
                f"planning pool {quoted(self.name)} failed: {type(exc).__name__}: {exc} (see the "
                "server log); check the ranks' memory claims, max_num_blocks and "
                "num_gpu_blocks_override"
            )
            return
        identity = self._new_identity(plan, regs, memory)
        ranks = {
            slot.rank: RankRecord(
                slot.rank,
                {
                    **registration_to_dict(slot.registration, slot.available_bytes),
                    "allocated": False,
                },
                "",
            )
            for slot in self.slots.values()
        }
        if self.state_dir is not None:
            try:
                store = await loop.run_in_executor(
                    None, self._create_store, identity, cache, list(ranks.values())
                )
            except (OSError, sqlite3.Error, StateError) as exc:
                log.error(
                    "pool %r: cannot keep its state in %s: %s", self.name, self.state_dir, exc
                )
                self._plan_failed(
                    f"pool {quoted(self.name)} was planned but its state cannot be kept in "
                    f"{self.state_dir}: {exc}"
                )
                return
            self._start_persistence(store)
        self.identity = identity
        self._rank_records = ranks
        self.plan = plan
        self.cache = cache
        self.hash_seed = cache.hash_seed
        self.error = ""
        self._set_state(PoolState.PLANNED)

    def _new_identity(
        self, plan: Any, regs: list[Registration], memory: list[int]
    ) -> dict[str, Any]:
        """What a state of this pool is made for: its planning settings and inputs (each
        rank's registration and offered bytes), the plan's digest and the event epoch."""
        return {
            "pool": self.name,
            "store_id": new_store_id(),
            "epoch": self.events.epoch,
            "created_at": time.time(),
            "kvsvc_version": __version__,
            "settings": {name: getattr(self.config, name) for name in PLAN_SETTINGS},
            "plan_ranks": [
                registration_to_dict(reg, available)
                for reg, available in zip(regs, memory, strict=True)
            ],
            "plan_digest": plan_digest(plan),
        }

    def _create_store(
        self, identity: dict[str, Any], cache: Any, ranks: list[RankRecord]
    ) -> PoolStore:
        """The pool's new store, starting with a snapshot of its empty cache (a thread)."""
        assert self.state_dir is not None
        snapshot = Snapshot(
            identity=identity,
            generation=1,
            journal_seq=0,
            state=encode_state(cache.to_state()),
            server_state={"calls": []},
            ranks=ranks,
        )
        return PoolStore.create(
            self.state_dir,
            identity,
            snapshot,
            synchronous=self.state_options.get("synchronous", "normal"),
        )

    def _start_persistence(self, store: PoolStore) -> None:
        options = self.state_options
        self.persistence = PoolPersistence(
            store,
            synchronous=options.get("synchronous", "normal"),
            snapshot_every=options.get("snapshot_every", DEFAULT_SNAPSHOT_EVERY),
            snapshot_min_interval_s=options.get("snapshot_min_interval_s", 10.0),
            checkpoint_interval_s=options.get("checkpoint_interval_s", 1.0),
            publish=self.events.append,
        )
        with contextlib.suppress(RuntimeError):  # no running loop yet: start_state does
            self.persistence.start()

    def _plan_failed(self, error: str) -> None:
        """Drop every registration and tell every rank's plan stream why.

        Notifies even when the state stays WAITING_FOR_WORKERS (it does: planning starts
        there): the ranks that registered earlier wait on their plan streams for a change,
        and without one they would wait forever for a plan that is not coming.
        """
        self.num_plan_failures += 1
        self.error = error
        # Nothing half-planned: every rank must register again to retry.
        self._dropped_sessions = {s.session_id: error for s in self.slots.values()}
        self.slots.clear()
        if self.state != PoolState.WAITING_FOR_WORKERS:
            self._set_state(PoolState.WAITING_FOR_WORKERS)
        else:
            self._notify()

    def _check_num_blocks(self, plan: Any) -> None:
        """A plan above ``max_num_blocks`` fails before the manager builds its blocks."""
        limit = self.config.max_num_blocks
        if plan.num_blocks > limit:
            raise PlanningError(
                f"pool {quoted(self.name)}: the plan has {plan.num_blocks} blocks per rank, above "
                f"max_num_blocks={limit}; raise max_num_blocks or set "
                "num_gpu_blocks_override (or check the ranks' memory claims)"
            )

    def _build_cache(self, plan: Any) -> Any:
        from kvsvc.core import PoolKVCache

        return PoolKVCache(
            plan.scheduler_config,
            max_model_len=plan.max_model_len,
            enable_caching=self.config.enable_prefix_caching,
            hash_algo=self.config.hash_algo,
            hash_seed=self.config.hash_seed,
            hash_block_size=plan.hash_block_size,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_requests=self.config.max_requests,
            recently_freed=self.config.recently_freed,
            prefix_cache_retention_interval=(
                None
                if self.config.prefix_cache_retention_interval < 0
                else self.config.prefix_cache_retention_interval
            ),
            max_tokens=self._max_pool_tokens(plan),
            max_unscheduled_tokens=self._max_unscheduled_tokens(plan),
        )

    def _max_unscheduled_tokens(self, plan: Any) -> int:
        """The pool's ``max_unscheduled_tokens``: configured, or its default."""
        if self.config.max_unscheduled_tokens is not None:
            return self.config.max_unscheduled_tokens
        capacity = max(plan.num_blocks - 1, 1) * plan.block_size
        return max(capacity, DEFAULT_UNSCHEDULED_TOKENS_PER_MODEL_LEN * plan.max_model_len)

    def _max_pool_tokens(self, plan: Any) -> int:
        """The pool's ``max_pool_tokens``: configured, or its default (see PoolConfig)."""
        if self.config.max_pool_tokens is not None:
            return self.config.max_pool_tokens
        capacity = max(plan.num_blocks - 1, 1) * plan.block_size
        return max(
            DEFAULT_POOL_TOKENS_PER_CAPACITY * capacity,
            DEFAULT_POOL_TOKENS_PER_MODEL_LEN * plan.max_model_len,
        )

    def slot_for(self, rank: int, session_id: str) -> RankSlot:
        """The slot of ``rank`` if ``session_id`` is its current session.

        Raises:
            NotFound: the rank is not registered under that session (register again).
        """
        slot = self.slots.get(rank)
        if slot is None or not _same_secret(slot.session_id, session_id):
            raise NotFound(
                f"rank {rank} of pool {quoted(self.name)} has no registration with session "
                f"{quoted(session_id)}; register again"
            )
        return slot

    def snapshot_for(self, rank: int) -> PlanSnapshot:
        config = None
        if self.plan is not None and self.state != PoolState.WAITING_FOR_WORKERS:
            config = self.plan.worker_configs[rank]
        return PlanSnapshot(
            state=self.state,
            config=config,
            error=self.error,
            max_model_len=self.plan.max_model_len if self.plan is not None else 0,
        )

    async def watch_plan(self, rank: int, session_id: str) -> AsyncIterator[PlanSnapshot]:
        """Yield the rank's plan view now and after every change, until cancelled.

        The stream being open is what makes the rank live; when it closes the rank may
        be replaced and, once the pool is serving, the pool is DEGRADED.
        """
        dropped = self._dropped_sessions.get(session_id)
        if dropped is not None and rank not in self.slots:
            yield PlanSnapshot(self.state, None, dropped, 0)
            return
        slot = self.slot_for(rank, session_id)
        slot.open_streams += 1
        slot.ever_streamed = True
        self._refresh_health()
        last: PlanSnapshot | None = None
        try:
            while True:
                # Take the event before reading the state: a change made while this
                # generator is suspended in ``yield`` then still wakes it (reading
                # ``self._changed`` after the yield would pick up the fresh, unset event
                # and miss that change for good).
                changed = self._changed
                if self.slots.get(rank) is not slot:
                    # Replaced, or dropped by a failed plan: say why once, then end.
                    yield PlanSnapshot(self.state, None, self.error, 0)
                    return
                snapshot = self.snapshot_for(rank)
                if snapshot != last:
                    yield snapshot
                    last = snapshot
                await changed.wait()
        finally:
            slot.open_streams -= 1
            if slot.open_streams == 0 and self.slots.get(rank) is slot and self.plan is not None:
                log.warning(
                    "pool %s: rank %d (%s on %s) lost its plan stream",
                    self.name,
                    rank,
                    slot.registration.device,
                    slot.registration.hostname or "?",
                )
            self._refresh_health()

    async def report_allocation(
        self,
        rank: int,
        session_id: str,
        *,
        num_blocks: int,
        allocated_bytes: int,
        memory_free_bytes: int,
        views: list[Any],
        allocation_id: str = "",
    ) -> PoolState:
        """Record a rank's allocation; the pool is READY once every rank reported.

        Tensors with another identity than the ones the rank last reported (reallocated,
        or no identity given) hold none of the pool's KV data: the pool is invalidated.
        """
        slot = self.slot_for(rank, session_id)
        if self.plan is None:
            raise FailedPrecondition(f"pool {quoted(self.name)} has no plan yet; wait for it")
        planned = self.plan.worker_configs[rank].num_blocks
        if num_blocks != planned:
            raise InvalidArgument(
                "num_blocks",
                f"rank {rank} allocated {num_blocks} blocks but its plan has {planned}",
            )
        if len(allocation_id) > 128:
            raise InvalidArgument("allocation_id", "longer than 128 characters")
        async with self.lock:  # an invalidation changes the core: one writer at a time
            memory = self.rank_memory.get(rank, RankMemory())
            ticket = 0
            if memory.allocated and (not allocation_id or allocation_id != memory.allocation_id):
                ticket = self.invalidate(f"rank {rank} reported other tensors than before")
            self.rank_memory[rank] = RankMemory(True, allocation_id)
            slot.allocation_id = allocation_id
            ticket = max(ticket, self._persist_rank(slot))
        await self.durable(ticket)
        if self.slots.get(rank) is not slot:
            raise NotFound(f"rank {rank} of pool {quoted(self.name)} was replaced meanwhile")
        slot.allocated = True
        slot.allocated_bytes = allocated_bytes
        slot.memory_free_bytes = memory_free_bytes
        slot.views = views
        slot.last_seen = self._clock()
        self.num_allocation_reports += 1
        self._refresh_health()
        return self.state

    def heartbeat(self, rank: int, session_id: str, memory_free_bytes: int) -> PoolState | None:
        """Record a heartbeat; None when the session is unknown (the agent must re-register)."""
        slot = self.slots.get(rank)
        if slot is None or not _same_secret(slot.session_id, session_id):
            return None
        slot.last_seen = self._clock()
        if memory_free_bytes:
            slot.memory_free_bytes = memory_free_bytes
        self._refresh_health()
        return self.state

    def _rank_healthy(self, slot: RankSlot, now: float) -> bool:
        return slot.open_streams > 0 and now - slot.last_seen < self.heartbeat_timeout_s

    def rank_live(self, slot: RankSlot, now: float) -> bool:
        """Whether a rank counts as alive (plan stream open, heartbeat in time): the admin
        view shows it, so an operator sees which rank made the pool DEGRADED."""
        return self._rank_healthy(slot, now)

    def _refresh_health(self) -> None:
        """Move between PLANNED, READY and DEGRADED from the ranks' liveness."""
        if self.plan is None:
            return
        now = self._clock()
        all_reported = len(self.slots) == self.config.world_size and all(
            s.allocated for s in self.slots.values()
        )
        if self.state == PoolState.PLANNED and not all_reported:
            return
        healthy = all_reported and all(self._rank_healthy(s, now) for s in self.slots.values())
        self._set_state(PoolState.READY if healthy else PoolState.DEGRADED)

    def check_heartbeats(self) -> None:
        """Called periodically: DEGRADED when a rank went silent, READY when all are back."""
        if self.state in (PoolState.READY, PoolState.DEGRADED):
            self._refresh_health()

    # ---------------------------------------------------------------- engine side

    def ensure_serving(self) -> Any:
        """The pool's KV cache manager, if engine calls may be served now.

        Raises:
            FailedPrecondition: the pool is not READY (or DEGRADED) yet.
        """
        if self.state in (PoolState.READY, PoolState.DEGRADED):
            return self.cache
        if self.state == PoolState.PLANNED:
            reported = sum(1 for s in self.slots.values() if s.allocated)
            if self.restored:
                # A restart on a state directory: the gap engines retry through.
                raise Unavailable(
                    f"pool {quoted(self.name)} was restored from its saved state and waits for its "
                    f"ranks to come back ({reported} of {self.config.world_size} reported "
                    "their tensors); retry"
                )
            detail = f"{reported} of {self.config.world_size} ranks reported their allocation"
        else:
            detail = f"{len(self.slots)} of {self.config.world_size} ranks registered"
            if self.error:
                detail += f"; last planning error: {self.error}"
        raise FailedPrecondition(
            f"pool {quoted(self.name)} is not ready ({self.state.name}: {detail})"
        )

    def ensure_writable(self) -> Any:
        """:meth:`ensure_serving` for calls that change the pool: also refused while its
        state cannot be written (nothing is acknowledged that the disk does not hold).

        Raises:
            FailedPrecondition: the pool is not READY (or DEGRADED) yet.
            Unavailable: restored and waiting for its ranks, or its state store failed.
        """
        cache = self.ensure_serving()
        if self.persistence is not None:
            self.persistence.check_writable()
        return cache

    def drain_events(self) -> list[Any]:
        """Take the core's pending KV events as the next batches (after every change: one,
        or several when the change stored more than one batch may carry).

        Without persistence the batch goes to the replay log (its subscribers) at once;
        with it, :meth:`journal` holds it until the change it records is on disk, so no
        subscriber sees an event that a crash could take back (and whose sequence number
        the restarted server would give to another batch).

        Returns:
            The batches, in sequence order (none when the change made no event).
        """
        cache = self.cache
        if cache is None:
            return []
        batches = cache.take_event_batches()
        if self.persistence is None:
            for batch in batches:
                self.events.append(batch)
        return batches

    # ---------------------------------------------------------------- state (persistence)

    def configure_state(self, directory: Path | None, **options: Any) -> None:
        """Keep the pool's state in ``directory`` from its planning on (None: in memory
        only). ``options``: ``synchronous``, ``snapshot_every``,
        ``snapshot_min_interval_s``, ``checkpoint_interval_s`` (see PoolPersistence)."""
        self.state_dir = directory
        self.state_options = options

    def journal(
        self,
        kind: int,
        engine: str,
        payload: bytes,
        reply: bytes,
        batches: Sequence[Any],
        work: int = 0,
    ) -> int:
        """Record a call that changed the pool (under the lock, right after the change and
        the events drain; ``work``: tokens + 64 per operation, as the servicers count it);
        returns the ticket to wait on (0: nothing is persisted)."""
        persistence = self.persistence
        if persistence is None:
            return 0
        ticket = persistence.record(
            kind,
            engine,
            payload,
            batches[-1].seq if batches else 0,
            batches[0].timestamp if batches else 0.0,
            reply_digest(reply),
            batches,
            1 + work // 64,
        )
        if persistence.snapshot_due():
            self.schedule_snapshot()
        return ticket

    async def durable(self, ticket: int) -> None:
        """Wait until the change of ``ticket`` is on disk (at once when not persisted).

        Raises:
            Unavailable: writing the state failed; the change must not be acknowledged.
        """
        if ticket and self.persistence is not None:
            await self.persistence.durable(ticket)

    def invalidate(self, reason: str) -> int:
        """The pool's KV data is gone: empty the prefix index and flag every live request
        (see :meth:`PoolKVCache.invalidate`). Under the lock; returns the journal ticket.
        """
        assert self.cache is not None
        flagged, dropped = self.cache.invalidate()
        batches = self.drain_events()
        self.num_invalidations += 1
        log.warning(
            "pool %s: %s: prefix index cleared (%d cached blocks), %d live requests must be "
            "recomputed",
            self.name,
            reason,
            dropped,
            flagged,
        )
        return self.journal(JournalKind.INVALIDATE, "", reason.encode(), b"", batches)

    def _persist_rank(self, slot: RankSlot) -> int:
        """Record the rank's current registration and tensor identity; returns the ticket."""
        memory = self.rank_memory.get(slot.rank, RankMemory())
        record = RankRecord(
            slot.rank,
            {
                **registration_to_dict(slot.registration, slot.available_bytes),
                "allocated": memory.allocated,
            },
            memory.allocation_id,
        )
        self._rank_records[slot.rank] = record
        if self.persistence is None:
            return 0
        return self.persistence.update_rank(record)

    def capture(self) -> SnapshotCapture:
        """The pool's state now, copied (under the lock, between two calls)."""
        assert self.cache is not None
        # Copying makes ~10 objects per request and block list: a collection in the middle
        # would walk them all, for nothing (none is garbage).
        enabled = gc.isenabled()
        gc.disable()
        try:
            core_state = self.cache.to_state()
        finally:
            if enabled:
                gc.enable()
        return SnapshotCapture(
            core_state=core_state,
            server_state={"calls": self.calls.to_state()},
            ranks=[self._rank_records[rank] for rank in sorted(self._rank_records)],
            journal_seq=self.persistence.last_seq if self.persistence is not None else 0,
            work=self.persistence.work_since_snapshot if self.persistence is not None else 0,
        )

    def schedule_snapshot(self) -> None:
        """Take a snapshot soon (a task: it waits for the lock)."""
        if self._snapshot_task is None or self._snapshot_task.done():
            self._snapshot_task = asyncio.get_running_loop().create_task(self.snapshot())

    async def snapshot(self) -> bool:
        """Replace the journal with a snapshot now (the next restart replays nothing).

        Returns:
            Whether one was written (False: not persisted, busy, or it failed: logged,
            and the journal stays as it was).
        """
        persistence = self.persistence
        if persistence is None or persistence.snapshotting or persistence.failed:
            return False
        persistence.snapshotting = True
        try:
            async with self.lock:
                capture = self.capture()
            await persistence.install_snapshot(capture)
        except Unavailable:
            return False
        except (OSError, sqlite3.Error, ValueError) as exc:
            log.error("pool %r: writing a snapshot failed (the journal stays): %s", self.name, exc)
            return False
        finally:
            persistence.snapshotting = False
        # Rows journaled while it was written may make the next one due already.
        asyncio.get_running_loop().call_soon(self._snapshot_if_due)
        return True

    def _snapshot_if_due(self) -> None:
        if self.persistence is not None and self.persistence.snapshot_due():
            self.schedule_snapshot()

    async def export_snapshot(self, path: Path) -> None:
        """Write the pool's whole state now to a new snapshot file at ``path`` (for
        ``kvsvc serve --restore``), whether or not it is kept in a state directory.

        Raises:
            FailedPrecondition: the pool is not planned yet.
            OSError, sqlite3.Error: the file could not be written.
        """
        if self.cache is None or self.identity is None:
            raise FailedPrecondition(
                f"pool {quoted(self.name)} has no state yet: it is not planned"
            )
        async with self.lock:
            capture = self.capture()
        identity = self.identity
        generation = (
            self.persistence.store.snapshot_generation + 1 if self.persistence is not None else 1
        )

        def write() -> None:
            write_snapshot(
                path,
                Snapshot(
                    identity=identity,
                    generation=generation,
                    journal_seq=capture.journal_seq,
                    state=encode_state(capture.core_state),
                    server_state=capture.server_state,
                    ranks=capture.ranks,
                ),
            )

        await asyncio.get_running_loop().run_in_executor(None, write)

    def restore(
        self,
        snapshot: Snapshot,
        journal: Iterable[JournalRecord] = (),
        ranks: list[RankRecord] | None = None,
        store: PoolStore | None = None,
    ) -> int:
        """Become the pool a saved state describes: its plan (planned anew from the saved
        inputs, and checked against the saved plan's digest), its core state, its event
        epoch and sequence, and its journal replayed on top. The pool is then PLANNED and
        restored: engine calls wait (UNAVAILABLE) until every rank is back.

        Nothing is taken over before everything loaded and replayed: a failure leaves
        the pool as it was.

        Args:
            snapshot: the state to start from.
            journal: the rows after the snapshot, in order.
            ranks: the ranks as last persisted (default: the snapshot's).
            store: where the state goes on from (None: in memory only).

        Returns:
            The journal rows replayed.

        Raises:
            StateError: the state was made for another pool or plan, is damaged, or its
                replay does not give the replies that were acknowledged.
        """
        from kvsvc.core import PoolKVCache
        from kvsvc.core.state import StateFormatError, decode_state
        from kvsvc.planner import plan_kv_cache

        identity = snapshot.identity
        where = f"the saved state of pool {quoted(self.name)}"
        if identity.get("pool") != self.name:
            raise StateError(f"{where} is pool {identity.get('pool')!r}'s state, not this pool's")
        settings = identity.get("settings", {})
        changed = [
            f"{name} {settings.get(name)!r} -> {getattr(self.config, name)!r}"
            for name in PLAN_SETTINGS
            if settings.get(name) != getattr(self.config, name)
        ]
        if changed:
            raise StateError(
                f"{where} was planned with other settings than the config has now "
                f"({'; '.join(changed)}): restore the settings, or move the pool's state "
                "files away to plan it afresh (its live requests and cached blocks are lost)"
            )
        enabled = gc.isenabled()
        gc.disable()  # millions of objects are made: collections would only walk them
        try:
            try:
                saved = [registration_from_dict(data) for data in identity["plan_ranks"]]
                regs = [reg for reg, _ in saved]
                plan = plan_kv_cache(
                    [reg.specs for reg in regs],
                    [available for _, available in saved],
                    self._planner_options(regs),
                )
            except (KeyError, TypeError, ValueError, PlanningError) as exc:
                raise StateError(f"{where}: its plan cannot be made again: {exc}") from None
            if plan_digest(plan) != identity.get("plan_digest"):
                raise StateError(
                    f"{where} was made for another plan than this kvsvc makes from the same "
                    f"inputs (made by kvsvc {identity.get('kvsvc_version')}, this is "
                    f"{__version__}): run that version, or move the pool's state files away"
                )
            try:
                cache = PoolKVCache.from_state(plan.scheduler_config, decode_state(snapshot.state))
            except (StateFormatError, ValueError, KeyError, TypeError) as exc:
                raise StateError(f"{where} does not load: {exc}") from None
            if self.config.hash_seed is not None and self.config.hash_seed != cache.hash_seed:
                raise StateError(
                    f"{where} was hashed with another hash_seed than the config gives now; "
                    "restore the seed (every cached block's hash depends on it)"
                )
            base_seq = cache.manager.events.last_seq if cache.manager.events is not None else 0
            calls = CallLog(self.calls.capacity)
            try:
                calls.load_state(snapshot.server_state.get("calls", []))
            except (ValueError, TypeError) as exc:
                raise StateError(f"{where}: damaged saved replies: {exc}") from None
            batches: list[Any] = []
            num_replayed, num_invalidations = self._replay(cache, batches, calls, journal, where)
        finally:
            if enabled:
                gc.enable()
        cache.set_limits(
            max_requests=self.config.max_requests,
            recently_freed=self.config.recently_freed,
            max_tokens=self._max_pool_tokens(plan),
            max_unscheduled_tokens=self._max_unscheduled_tokens(plan),
        )
        # Everything loaded: take it over.
        self.events.restore(identity["epoch"], base_seq)
        for batch in batches:
            self.events.append(batch)
        self.calls = calls
        self.plan = plan
        self.cache = cache
        self.hash_seed = cache.hash_seed
        self.identity = identity
        self.num_invalidations += num_invalidations
        rank_records = ranks if ranks is not None else snapshot.ranks
        self._rank_records = {r.rank: r for r in rank_records}
        self._restored = {}
        self.rank_memory = {}
        for record in rank_records:
            self._restored[record.rank] = registration_from_dict(record.registration)
            self.rank_memory[record.rank] = RankMemory(
                bool(record.registration.get("allocated")), record.allocation_id
            )
        self.restored = True
        self.error = ""
        self.state = PoolState.PLANNED
        if store is not None:
            self._start_persistence(store)
        return num_replayed

    @staticmethod
    def _replay(
        cache: Any,
        batches: list[Any],
        calls: CallLog,
        journal: Iterable[JournalRecord],
        where: str,
    ) -> tuple[int, int]:
        """Apply the journal's rows again; each must give the reply and event batch it gave
        when served. Returns the rows replayed and the invalidations among them."""
        count = invalidations = 0
        for record in journal:
            request = None
            try:
                if record.kind == JournalKind.RESET:
                    reply = b"\x01" if cache.reset_prefix_cache() else b"\x00"
                elif record.kind == JournalKind.INVALIDATE:
                    cache.invalidate()
                    reply = b""
                    invalidations += 1
                else:
                    request = parse_journaled(record.kind, record.payload)
                    response, _ = replay_call(cache, record.kind, request, record.engine)
                    reply = response.SerializeToString()
            except (KvsvcError, ValueError) as exc:
                raise StateError(
                    f"{where}: replaying journal row {record.seq} failed: {exc}"
                ) from None
            drained = cache.take_event_batches()
            got = drained[-1].seq if drained else 0
            if reply_digest(reply) != record.reply_digest or got != record.event_seq:
                raise StateError(
                    f"{where}: journal row {record.seq} ({JournalKind(record.kind).name}) "
                    "replays to another reply than the one acknowledged (event batch "
                    f"{got}, acknowledged {record.event_seq}): refusing to serve a state "
                    "that differs from the one before the restart"
                )
            for batch in drained:
                batch.timestamp = record.event_ts
                batches.append(batch)
            if request is not None and request.call_id:
                calls.put(record.engine, request.call_id, record.kind, response, 0)
            count += 1
        return count, invalidations

    def attach_store(self, store: PoolStore) -> None:
        """Go on persisting the (restored) pool's state in ``store``."""
        self._start_persistence(store)

    def start_state(self) -> None:
        """Start the background work of a persisted pool (on the server's loop)."""
        if self.persistence is not None:
            self.persistence.start()

    async def close_state(self, *, final_snapshot: bool = True) -> None:
        """Stop persisting: with ``final_snapshot``, replace the journal by a snapshot
        first (a graceful stop: the next start, perhaps of a newer kvsvc, replays nothing).
        """
        persistence = self.persistence
        if persistence is None:
            return
        if self._snapshot_task is not None:
            await asyncio.gather(self._snapshot_task, return_exceptions=True)
        if final_snapshot and persistence.records_since_snapshot and not persistence.failed:
            await self.snapshot()
        await persistence.close()
        self.persistence = None

    # ---------------------------------------------------------------- accounting

    def stats_allocate(self, outcome: Any) -> None:
        counters = self.counters
        if outcome.ok:
            counters.allocate_ok += 1
        else:
            counters.allocate_no_space += 1

    def stats_free(self, num_requests: int, num_freed_blocks: int, preempted: bool) -> None:
        if preempted:
            self.counters.preempt_requests += num_requests
        else:
            self.counters.free_requests += num_requests
        self.counters.freed_blocks += num_freed_blocks

    def stats_step(self, num_operations: int) -> None:
        self.counters.steps += 1
        self.counters.step_operations += num_operations
        if self.step_size_observer is not None:
            self.step_size_observer(num_operations)

    def stats_lookup(self, num_cached_tokens: int) -> None:
        self.counters.lookups += 1
        self.counters.lookup_hit_tokens += num_cached_tokens
