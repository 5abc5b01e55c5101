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
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from kvsvc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PlanningError,
)
from kvsvc.server.config import PoolConfig
from kvsvc.server.events import EventLog
from kvsvc.server.seclog import security_log
from kvsvc.specs import AttentionSpec, KVCacheSpec, iter_layer_specs

log = logging.getLogger("kvsvc.server")

# The most bytes a rank may claim in any memory figure: 2^48 B = 256 TiB, far above any
# device or host, far below what would overflow the planner's arithmetic into nonsense.
MAX_MEMORY_BYTES = 2**48
_MEMORY_FIELDS = ("total_bytes", "free_bytes", "non_kv_bytes", "kv_cache_bytes")


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


@dataclass(slots=True)
class RankSlot:
    registration: Registration
    session_id: str
    registered_at: float
    last_seen: float
    available_bytes: int
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
                log = security_log.warning if state != PoolState.READY else security_log.info
                log("pool %s: %s -> %s%s", self.name, previous.name, state.name, self._why())
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
                f"pool {self.name!r} has world size {self.config.world_size}, "
                f"the agent says {reg.world_size}",
            )
        if not 0 <= reg.rank < self.config.world_size:
            raise InvalidArgument(
                "rank",
                f"{reg.rank} is outside [0, {self.config.world_size}) for pool {self.name!r}",
            )
        block_size = self.config.block_size
        if block_size is not None:
            for name, spec in reg.specs.items():
                for inner in iter_layer_specs(spec):
                    if isinstance(inner, AttentionSpec) and inner.block_size % block_size:
                        raise InvalidArgument(
                            "layers",
                            f"layer {name} has block size {inner.block_size}, not a multiple of "
                            f"pool {self.name!r}'s block size {block_size}",
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
                    f"rank {reg.rank} of pool {self.name!r} is held by a live agent on "
                    f"{existing.registration.hostname or '?'} ({existing.registration.device}); "
                    "stop it first"
                )
            if existing is not None and self.plan is not None:
                self._check_replacement(existing, reg, available)
            slot = RankSlot(
                registration=reg,
                # A secret: the rank's later calls must carry it (compared in constant time).
                session_id=secrets.token_hex(16),
                registered_at=now,
                last_seen=now,
                available_bytes=available,
            )
            self.slots[reg.rank] = slot
            self.num_registrations += 1
            if self.plan is not None:
                # A replaced rank comes back with fresh memory: cached blocks would be read
                # from bytes it no longer has, so no future request may hit them.
                if existing is not None:
                    security_log.warning(
                        "pool %s: rank %d is back (%s on %s), replacing its lost agent%s",
                        self.name,
                        reg.rank,
                        reg.device,
                        reg.hostname or "?",
                        "; its cached blocks are forgotten" if existing.allocated else "",
                    )
                if existing is not None and existing.allocated:
                    self._forget_cached_blocks()
                if self.state == PoolState.READY:
                    self._set_state(PoolState.DEGRADED)
                self._notify()
            elif len(self.slots) == self.config.world_size:
                await self._plan_locked()
            else:
                self.error = ""
                self._notify()
            return slot

    def _check_replacement(self, old: RankSlot, reg: Registration, available: int) -> None:
        if old.registration.specs != reg.specs:
            raise InvalidArgument(
                "layers",
                f"rank {reg.rank} registered different layer specs than the ones pool "
                f"{self.name!r} was planned for; restart the pool to plan anew",
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

    async def _plan_locked(self) -> None:
        from kvsvc.planner import PlannerOptions, plan_kv_cache

        regs = [self.slots[r].registration for r in range(self.config.world_size)]
        max_model_len = self.config.max_model_len
        if max_model_len is None:
            max_model_len = regs[0].max_model_len
        try:
            if not max_model_len:
                raise PlanningError(
                    f"pool {self.name!r} has no max_model_len: set it in the pool config "
                    "(or -1 to fit memory), or have the agents report the model's length"
                )
            options = PlannerOptions(
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
            specs = [reg.specs for reg in regs]
            memory = [self.slots[r].available_bytes for r in range(self.config.world_size)]
            loop = asyncio.get_running_loop()
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
                f"planning pool {self.name!r} failed: {type(exc).__name__}: {exc} (see the "
                "server log); check the ranks' memory claims, max_num_blocks and "
                "num_gpu_blocks_override"
            )
            return
        self.plan = plan
        self.cache = cache
        self.hash_seed = cache.hash_seed
        self.error = ""
        self._set_state(PoolState.PLANNED)

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
                f"pool {self.name!r}: the plan has {plan.num_blocks} blocks per rank, above "
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
        )

    def _forget_cached_blocks(self) -> None:
        assert self.cache is not None
        assert self.plan is not None
        self.cache.evict_blocks(range(1, self.plan.num_blocks))
        self.drain_events()

    def slot_for(self, rank: int, session_id: str) -> RankSlot:
        """The slot of ``rank`` if ``session_id`` is its current session.

        Raises:
            NotFound: the rank is not registered under that session (register again).
        """
        slot = self.slots.get(rank)
        if slot is None or not _same_secret(slot.session_id, session_id):
            raise NotFound(
                f"rank {rank} of pool {self.name!r} has no registration with session "
                f"{session_id!r}; register again"
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
                security_log.warning(
                    "pool %s: rank %d (%s on %s) lost its plan stream",
                    self.name,
                    rank,
                    slot.registration.device,
                    slot.registration.hostname or "?",
                )
            self._refresh_health()

    def report_allocation(
        self,
        rank: int,
        session_id: str,
        *,
        num_blocks: int,
        allocated_bytes: int,
        memory_free_bytes: int,
        views: list[Any],
    ) -> PoolState:
        slot = self.slot_for(rank, session_id)
        if self.plan is None:
            raise FailedPrecondition(f"pool {self.name!r} has no plan yet; wait for it")
        planned = self.plan.worker_configs[rank].num_blocks
        if num_blocks != planned:
            raise InvalidArgument(
                "num_blocks",
                f"rank {rank} allocated {num_blocks} blocks but its plan has {planned}",
            )
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
            detail = f"{reported} of {self.config.world_size} ranks reported their allocation"
        else:
            detail = f"{len(self.slots)} of {self.config.world_size} ranks registered"
            if self.error:
                detail += f"; last planning error: {self.error}"
        raise FailedPrecondition(f"pool {self.name!r} is not ready ({self.state.name}: {detail})")

    def drain_events(self) -> None:
        """Move the core's pending KV events into the replay log (after every change)."""
        cache = self.cache
        if cache is None:
            return
        batch = cache.take_events()
        if batch is not None:
            self.events.append(batch)

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
