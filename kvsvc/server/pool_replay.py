"""A pool's saved state loaded: its plan made again from the saved inputs (and checked
against the saved plan's digest), its core state decoded, its saved replies, and its
journal replayed on top, each row checked against the reply it was acknowledged with.

The result (:class:`LoadedState`) is not yet any pool's: :meth:`Pool.restore
<kvsvc.server.pool.Pool.restore>` takes it over only once all of it loaded, so a
failure leaves the pool as it was.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import KvsvcError, PlanningError, quoted
from kvsvc.server.calls import CallLog, journal_units, parse_journaled, replay_call
from kvsvc.server.config import PoolConfig
from kvsvc.server.persistence.records import (
    JournalKind,
    JournalRecord,
    Snapshot,
    StateError,
    reply_digest,
)
from kvsvc.server.pool_identity import check_made_for, check_plan
from kvsvc.server.pool_planning import max_pool_tokens, max_unscheduled_tokens, planner_options
from kvsvc.server.registration import registration_from_dict


@dataclass(slots=True)
class LoadedState:
    """A saved state, loaded and replayed, for a pool to take over.

    Attributes:
        plan: the plan made again from the saved inputs.
        cache: the core (``PoolKVCache``) with the journal replayed, its bounds set.
        calls: the replies of recent calls (the snapshot's, and the replayed rows').
        base_seq: the event sequence the snapshot ends at.
        batches: the event batches the replayed rows made, in order.
        num_replayed: the journal rows replayed.
        num_invalidations: the invalidations among them.
        replay_units: what replaying them cost, as the snapshot trigger counts it.
    """

    plan: Any
    cache: Any
    calls: CallLog
    base_seq: int
    batches: list[Any]
    num_replayed: int
    num_invalidations: int
    replay_units: int


def load_saved_state(
    config: PoolConfig,
    snapshot: Snapshot,
    journal: Iterable[JournalRecord],
) -> LoadedState:
    """Load ``snapshot`` for the pool ``config`` describes and replay ``journal`` on it.

    Raises:
        StateError: the state was made for another pool or plan, is damaged, or its
            replay does not give the replies that were acknowledged.
    """
    from kvsvc.core import PoolKVCache
    from kvsvc.core.state import StateFormatError, decode_state
    from kvsvc.planner import plan_kv_cache

    identity = snapshot.identity
    where = f"the saved state of pool {quoted(config.name)}"
    check_made_for(identity, config, where)
    enabled = gc.isenabled()
    gc.disable()  # millions of objects are made: collections would only walk them
    try:
        try:
            saved = [registration_from_dict(data) for data in identity["plan_ranks"]]
            regs = [reg for reg, _ in saved]
            plan = plan_kv_cache(
                [reg.specs for reg in regs],
                [available for _, available in saved],
                planner_options(config, regs),
            )
        except (KeyError, TypeError, ValueError, PlanningError) as exc:
            raise StateError(f"{where}: its plan cannot be made again: {exc}") from None
        check_plan(identity, plan, where)
        try:
            cache = PoolKVCache.from_state(plan.scheduler_config, decode_state(snapshot.state))
        except (StateFormatError, ValueError, KeyError, TypeError) as exc:
            raise StateError(f"{where} does not load: {exc}") from None
        if config.hash_seed is not None and config.hash_seed != cache.hash_seed:
            raise StateError(
                f"{where} was hashed with another hash_seed than the config gives now; "
                "restore the seed (every cached block's hash depends on it)"
            )
        base_seq = cache.manager.events.last_seq if cache.manager.events is not None else 0
        calls = CallLog()
        try:
            calls.load_state(snapshot.server_state.get("calls", []))
        except (ValueError, TypeError) as exc:
            raise StateError(f"{where}: damaged saved replies: {exc}") from None
        batches: list[Any] = []
        num_replayed, num_invalidations, units = _replay_journal(
            cache, batches, calls, journal, where
        )
    finally:
        if enabled:
            gc.enable()
    cache.set_limits(
        max_requests=config.max_requests,
        recently_freed=config.recently_freed,
        max_tokens=max_pool_tokens(config, plan),
        max_unscheduled_tokens=max_unscheduled_tokens(config, plan),
    )
    return LoadedState(
        plan, cache, calls, base_seq, batches, num_replayed, num_invalidations, units
    )


def _replay_journal(
    cache: Any,
    batches: list[Any],
    calls: CallLog,
    journal: Iterable[JournalRecord],
    where: str,
) -> tuple[int, int, int]:
    """Apply the journal's rows again; each must give the reply and event batch it gave
    when served. Returns the rows replayed, the invalidations among them, and their
    replay work (:func:`~kvsvc.server.calls.journal_units`)."""
    count = invalidations = units = 0
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
            raise StateError(f"{where}: replaying journal row {record.seq} failed: {exc}") from None
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
            calls.put(record.engine, request.call_id, record.kind, reply, 0)
        units += journal_units(record.kind, request)
        count += 1
    return count, invalidations, units
