"""A pool's lifecycle on the server: ranks register, the pool is planned, ranks allocate.

::

    WAITING_FOR_WORKERS --(all W ranks registered, plan ok)--> PLANNED
    PLANNED --(all ranks reported their allocation)--> READY
    READY <--(a rank lost its plan stream or missed heartbeats / is back)--> DEGRADED

Engine calls are served in READY and DEGRADED. Planning failure (specs disagree, memory
too small, a plan above ``max_num_blocks``, or anything else that goes wrong while the plan
and the manager are built) drops every registration of the pool — nothing stays
half-planned — and records the error for ``GetPlan`` and every rank's plan stream.

What a registration must pass is :mod:`kvsvc.server.registration`'s; how a plan and its
core are made from the registrations, :mod:`kvsvc.server.pool_planning`'s.

A rank is *live* while its WatchPlan stream is open (or, just after registering, until
its first stream opens). Registering a rank that is live is refused; registering a rank
that is not (its agent died) replaces it and gets the same plan back when its specs match.

Concurrency: the pool runs on the server's event loop. Work is done synchronously between
awaits, so each change is atomic; the few calls heavy enough to offload (planning, very
large steps) run in a thread while holding ``lock``, which every engine call also takes,
so a pool always has one writer at a time.

Persistence: with a state directory the pool owns a
:class:`~kvsvc.server.persistence.writer.PoolPersistence` once planned (or restored): each
change is journaled under the lock and acknowledged once durable; snapshots, checkpoints
and the files are the writer's. A saved state is loaded and replayed by
:mod:`kvsvc.server.pool_replay` and taken over here (:meth:`Pool.restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

from kvsvc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PlanningError,
    Unavailable,
    quoted,
)
from kvsvc.server.calls import CallLog
from kvsvc.server.config import PoolConfig
from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.events import EventLog
from kvsvc.server.persistence.journal_store import PoolStore
from kvsvc.server.persistence.records import (
    JournalKind,
    JournalRecord,
    RankRecord,
    Snapshot,
    SnapshotCapture,
    StateError,
)
from kvsvc.server.persistence.snapshot_file import write_snapshot
from kvsvc.server.persistence.writer import ROW_REPLAY_UNITS, PoolPersistence, StateSettings
from kvsvc.server.pool_identity import new_identity
from kvsvc.server.pool_planning import build_pool_cache, check_plan_size, planner_options
from kvsvc.server.pool_replay import load_saved_state
from kvsvc.server.rank_slot import RankMemory, RankSlot, same_secret
from kvsvc.server.registration import (
    Registration,
    available_bytes,
    check_memory_claims,
    check_registration,
    check_replacement,
    log_rank_back,
    rank_record,
    registration_from_dict,
)
from kvsvc.server.seclog import security_log

log = logging.getLogger("kvsvc.server")


class PoolState(IntEnum):
    """Matches kvsvc.v1.PoolState."""

    WAITING_FOR_WORKERS = 1
    PLANNED = 2
    READY = 3
    DEGRADED = 4


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
        # Replies of recent calls by call_id (a retry answers the first attempt's reply).
        self.calls = CallLog()
        # What the pool's state is made for (set once planned or restored), and where it
        # is kept (see configure_state).
        self.identity: dict[str, Any] | None = None
        self.state_settings: StateSettings | None = None
        self.persistence: PoolPersistence | None = None
        # Restored from a saved state: engine calls wait (UNAVAILABLE) until every rank is
        # back and has confirmed (or lost) its tensors.
        self.restored = False
        # Set when the server stops: its plan streams end then, which is no lost rank.
        self.stopping = False
        self._restored: dict[int, tuple[Registration, int]] = {}
        self.rank_memory: dict[int, RankMemory] = {}
        self._rank_records: dict[int, RankRecord] = {}
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
            serving = (PoolState.READY, PoolState.DEGRADED)
            # Operations, not security: the ordinary log (kvsvc.security is for refusals
            # and takeovers). Not while the server stops: its own streams ending is no
            # degradation to report.
            if (state in serving or previous in serving) and not self.stopping:
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

    async def register(self, reg: Registration) -> RankSlot:
        """Register (or replace) a rank; plan the pool when every rank is in.

        Raises:
            InvalidArgument: bad rank/world size/specs/memory (nothing recorded).
            AlreadyExists: a live agent holds this rank.
        """
        async with self.lock:
            now = self._clock()
            check_registration(self.config, reg, [s.registration for s in self.slots.values()])
            check_memory_claims(reg)
            available = available_bytes(reg, self.config.gpu_memory_utilization)
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
                needed = self.planned_bytes(reg.rank)
                check_replacement(
                    self.config, previous, reg, available, needed, self._replan_hint()
                )
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
                    log_rank_back(self.name, reg, existing is not None, lost, memory.allocated)
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

    def _replan_hint(self) -> str:
        """How to plan the pool anew (for a rank that came back with other specs)."""
        settings = self.state_settings
        if self.persistence is None or settings is None:
            return "restart the pool to plan anew"
        return (
            f"its saved state in {settings.directory} holds live requests and cached blocks "
            "of that plan: to plan anew, stop the server and move "
            f"{PoolStore.path_for(settings.directory, self.name)} away (they are lost then)"
        )

    def planned_bytes(self, rank: int) -> int:
        assert self.plan is not None
        config = self.plan.worker_configs[rank]
        packed = {t.size for t in config.kv_cache_tensors if t.block_stride}
        return sum(t.size for t in config.kv_cache_tensors if not t.block_stride) + sum(packed)

    async def _plan_locked(self) -> None:
        from kvsvc.planner import plan_kv_cache

        regs = [self.slots[r].registration for r in range(self.config.world_size)]
        memory = [self.slots[r].available_bytes for r in range(self.config.world_size)]
        loop = asyncio.get_running_loop()
        try:
            options = planner_options(self.config, regs)
            specs = [reg.specs for reg in regs]
            self._planning = True
            try:
                plan = await loop.run_in_executor(None, plan_kv_cache, specs, memory, options)
                check_plan_size(self.config, plan)
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
        identity = new_identity(self.config, self.events.epoch, plan, regs, memory)
        ranks = {
            slot.rank: rank_record(slot.registration, slot.available_bytes, False, "")
            for slot in self.slots.values()
        }
        settings = self.state_settings
        if settings is not None:
            try:
                store = await loop.run_in_executor(
                    None, settings.create_store, identity, cache, list(ranks.values())
                )
            except (OSError, sqlite3.Error, StateError) as exc:
                log.error(
                    "pool %r: cannot keep its state in %s: %s", self.name, settings.directory, exc
                )
                self._plan_failed(
                    f"pool {quoted(self.name)} was planned but its state cannot be kept in "
                    f"{settings.directory}: {exc}"
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

    def _start_persistence(self, store: PoolStore, journal_units: int | None = None) -> None:
        """Persist from here on in ``store``; ``journal_units``: the replay work of the
        journal rows it holds already (None: none, or unknown)."""
        assert self.state_settings is not None
        self.persistence = self.state_settings.writer(
            store,
            lock=self.lock,
            capture=self.capture,
            publish=self.events.append,
            journal_units=journal_units,
        )
        with contextlib.suppress(RuntimeError):  # no running loop yet: start_state does
            self.persistence.start()

    def _build_cache(self, plan: Any) -> Any:
        """The pool's core cache for ``plan`` (in a thread; a failure is a planning
        failure, see :meth:`_plan_locked`)."""
        return build_pool_cache(self.config, plan)

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

    def slot_for(self, rank: int, session_id: str) -> RankSlot:
        """The slot of ``rank`` if ``session_id`` is its current session.

        Raises:
            NotFound: the rank is not registered under that session (register again).
        """
        slot = self.slots.get(rank)
        if slot is None or not same_secret(slot.session_id, session_id):
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
            if (
                slot.open_streams == 0
                and self.slots.get(rank) is slot
                and self.plan is not None
                and not self.stopping
            ):
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
        if slot is None or not same_secret(slot.session_id, session_id):
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

    def configure_state(self, settings: StateSettings | None) -> None:
        """Keep the pool's state as ``settings`` say from its planning on (None: in memory
        only)."""
        self.state_settings = settings

    def journal(
        self,
        kind: int,
        engine: str,
        payload: bytes,
        reply: bytes,
        batches: Sequence[Any],
        units: int = ROW_REPLAY_UNITS,
    ) -> int:
        """Record a call that changed the pool (under the lock, right after the change and
        the events drain; see :meth:`PoolPersistence.record`; ``units``: what replaying
        its row costs); returns the ticket to wait on (0: nothing is persisted)."""
        if self.persistence is None:
            return 0
        return self.persistence.record(kind, engine, payload, reply, batches, units)

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
        record = rank_record(
            slot.registration, slot.available_bytes, memory.allocated, memory.allocation_id
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
            write_snapshot(path, capture.to_snapshot(identity, generation))

        await asyncio.get_running_loop().run_in_executor(None, write)

    def restore(
        self,
        snapshot: Snapshot,
        journal: Iterable[JournalRecord] = (),
        ranks: list[RankRecord] | None = None,
        store: PoolStore | None = None,
    ) -> int:
        """Become the pool a saved state describes: its plan, its core state, its event
        epoch and sequence, and its journal replayed on top (loaded by
        :func:`~kvsvc.server.pool_replay.load_saved_state`). The pool is then
        PLANNED and restored: engine calls wait (UNAVAILABLE) until every rank is back.

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
        loaded = load_saved_state(self.config, snapshot, journal)
        # Everything loaded: take it over.
        identity = snapshot.identity
        self.events.restore(identity["epoch"], loaded.base_seq)
        for batch in loaded.batches:
            self.events.append(batch)
        self.calls = loaded.calls
        self.plan = loaded.plan
        self.cache = loaded.cache
        self.hash_seed = loaded.cache.hash_seed
        self.identity = identity
        self.num_invalidations += loaded.num_invalidations
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
            self._start_persistence(store, loaded.replay_units)
        return loaded.num_replayed

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
        await persistence.close(final_snapshot=final_snapshot)
        self.persistence = None
