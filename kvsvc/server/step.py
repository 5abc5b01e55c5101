"""Applying a Step: the hot path of the whole service.

An engine sends one Step per scheduling step, typically one decode token for each of a
few hundred running requests. The per-operation cost must be the core's own work, not
call and object overhead, so:

* pools with one full-attention group (most models) hand every run of running-request
  allocations to the core's columnar :meth:`~kvsvc.core.PoolKVCache.allocate_running`
  (one loop, no outcome object per operation) and build the response columns in bulk;
* other pools (hybrid, sliding window, Mamba) and the other operations (first calls,
  frees, speculative bookkeeping) go through ``allocate``/``free`` one by one.

Either way the operations apply in order, each atomically, and an invalid one is
rejected alone.
"""

from __future__ import annotations

from typing import Any

from kvsvc.core import AllocateOutcome, RunningColumns
from kvsvc.errors import InvalidArgument, KvsvcError
from kvsvc.server.errors import status_for
from kvsvc.server.wire import (
    STATUS_NO_SPACE,
    STATUS_OK,
    STATUS_RECOMPUTE,
    STATUS_REJECTED,
    StepColumns,
    StepResults,
    check_request_id,
    outcome_status,
    start_from_pb,
)
from kvsvc.v1 import kvcache_pb2

_ALLOCATE = kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE
_FREE = kvcache_pb2.STEP_OPERATION_TYPE_FREE
_PREEMPT = kvcache_pb2.STEP_OPERATION_TYPE_PREEMPT
_LOOKUP = kvcache_pb2.STEP_OPERATION_TYPE_LOOKUP
_CACHE = kvcache_pb2.STEP_OPERATION_TYPE_CACHE
# Operation types as the API names them (StepBuilder.allocate, .free, ...), by wire value.
_NAMES: dict[int, str] = {
    _ALLOCATE: "allocate",
    _FREE: "free",
    _PREEMPT: "preempt",
    _LOOKUP: "lookup",
    _CACHE: "cache",
}


# The scans of a Step's columns are native loops below, not ``list.count`` / ``in`` /
# ``any``: those compare each item through the generic protocol, ~140 instructions for
# each item that differs (``callgrind``); a decode Step's 256 statuses and types differ
# from every value scanned for but one, and five such scans were ~12% of its instructions.


def _count(values: list[int], value: int) -> int:
    """How many of ``values`` equal ``value`` (``values.count(value)``)."""
    found = 0
    for item in values:
        if item == value:
            found += 1
    return found


def _all_set(flags: list[bool]) -> bool:
    """Whether every flag is True (``False not in flags``)."""
    return all(flag for flag in flags)


def _all_zero(values: list[int]) -> bool:
    """Whether every value is 0 (``not any(values)``)."""
    return all(not value for value in values)


def _none_empty(request_ids: list[str]) -> bool:
    """Whether every request id is non-empty (``"" not in request_ids``)."""
    return all(request_id for request_id in request_ids)


def changed_the_pool(statuses: list[int], types: list[int]) -> bool:
    """Whether an operation other than a lookup succeeded (a lookup changes nothing)."""
    return any(status == STATUS_OK and types[i] != _LOOKUP for i, status in enumerate(statuses))


def apply_step(cache: Any, columns: StepColumns, counters: Any) -> StepResults:
    """Apply a Step's operations to ``cache``; count outcomes into ``counters``."""
    if cache.has_plain_tables:
        results = _apply_plain(cache, columns, counters)
    else:
        results = _apply_general(cache, columns, counters)
    if columns.free_queue_head_limit:
        results.free_queue_head = cache.free_queue_head(
            columns.free_queue_head_limit, columns.free_queue_head_offset
        )
    results.num_free_blocks = cache.usage_free_blocks()
    return results


def _lookup_outcome(cache: Any, columns: StepColumns, i: int, pos: int) -> AllocateOutcome:
    """A LOOKUP operation: the hit an admission would get now, as an outcome (no change)."""
    count = columns.num_token_ids[i]
    if (
        columns.num_new_tokens[i]
        or columns.num_lookahead_tokens[i]
        or columns.num_rejected_tokens[i]
        or columns.num_in_flight_tokens[i]
    ):
        raise InvalidArgument(
            f"operation {i}",
            "a lookup carries tokens and a start (its hashing context) only, no "
            "num_new_tokens, num_lookahead_tokens, num_rejected_tokens or "
            "num_in_flight_tokens",
        )
    start = columns.starts.get(i)
    parsed = start_from_pb(start, f"operation {i}'s start") if start is not None else None
    hits: tuple[list[int], ...]
    if parsed is not None and parsed.skip_prefix_cache_read:
        num_cached, hits = 0, tuple([] for _ in range(cache.num_groups))
    else:
        num_cached, hits = cache.lookup_blocks(
            columns.token_ids[pos : pos + count], parsed.hashing if parsed else None
        )
    zeros = (0,) * cache.num_groups
    return AllocateOutcome(True, hits, zeros, num_cached, 0, 0)


def _apply_one(
    cache: Any, columns: StepColumns, i: int, pos: int, counters: Any
) -> tuple[int, AllocateOutcome | int]:
    """Apply operation ``i`` through the general API.

    Returns:
        The next token position and the outcome (an allocation's, or the number of
        blocks a free released).

    Raises:
        KvsvcError: the operation is invalid (nothing changed).
    """
    kind = columns.types[i]
    count = columns.num_token_ids[i]
    request_id = columns.request_ids[i]
    # Bounds apply to the id as the engine sent it (request_ids may be namespaced).
    sent_id = columns.sent_request_ids[i]
    if kind == _ALLOCATE:
        tokens = columns.token_ids[pos : pos + count]
        start = columns.starts.get(i)
        if start is not None:
            # An admission names a new id: bound it here, or a Free could never name it.
            check_request_id(sent_id, f"operation {i}'s request id")
        elif not request_id:
            raise InvalidArgument(f"operation {i}'s request id", "must not be empty")
        packed = columns.packed_token_ids
        outcome = cache.allocate(
            request_id,
            tokens,
            columns.num_new_tokens[i],
            columns.num_lookahead_tokens[i],
            start_from_pb(start, f"operation {i}'s start") if start is not None else None,
            num_rejected_tokens=columns.num_rejected_tokens[i],
            # A first call's prompt is long: hand the core its already-checked packed form.
            packed_token_ids=packed[4 * pos : 4 * (pos + count)]
            if packed and start is not None
            else None,
            num_in_flight_tokens=columns.num_in_flight_tokens[i],
        )
        return pos + count, outcome
    if kind == _CACHE:
        if columns.num_new_tokens[i] or columns.num_lookahead_tokens[i] or i in columns.starts:
            raise InvalidArgument(
                f"operation {i}",
                "a cache carries tokens, num_rejected_tokens and num_in_flight_tokens only, "
                "no num_new_tokens, num_lookahead_tokens or start",
            )
        if not request_id:
            raise InvalidArgument(f"operation {i}'s request id", "must not be empty")
        outcome = cache.cache_outputs(
            request_id,
            columns.token_ids[pos : pos + count],
            num_rejected_tokens=columns.num_rejected_tokens[i],
            num_in_flight_tokens=columns.num_in_flight_tokens[i],
        )
        return pos + count, outcome
    if kind == _LOOKUP:
        return pos + count, _lookup_outcome(cache, columns, i, pos)
    if kind in (_FREE, _PREEMPT):
        check_request_id(sent_id, f"operation {i}'s request id")
        if (
            count
            or columns.num_new_tokens[i]
            or columns.num_lookahead_tokens[i]
            or columns.num_rejected_tokens[i]
            or columns.num_in_flight_tokens[i]
            or i in columns.starts
        ):
            raise InvalidArgument(
                f"operation {i}",
                f"a {_NAMES[kind]} carries a request id only, no tokens, counts or start",
            )
        preempted = kind == _PREEMPT
        freed: int = cache.free((request_id,), preempted=preempted)
        if preempted:
            counters.preempt_requests += 1
        else:
            counters.free_requests += 1
        counters.freed_blocks += freed
        return pos + count, freed
    raise InvalidArgument(
        f"operation {i}",
        f"unknown operation type {kind}; valid: "
        + ", ".join(f"{name} ({value})" for value, name in _NAMES.items()),
    )


def _apply_general(cache: Any, columns: StepColumns, counters: Any) -> StepResults:
    results = StepResults(cache.num_groups)
    statuses = results.statuses
    pos = 0
    for i in range(len(columns.types)):
        count = columns.num_token_ids[i]
        try:
            pos, outcome = _apply_one(cache, columns, i, pos, counters)
        except KvsvcError as exc:
            pos += count
            results.add_error(i, status_for(exc).value[0], str(exc))
            continue
        if isinstance(outcome, int):
            results.add_free(outcome)
            continue
        ok = outcome.ok
        if outcome.released:
            results.released = True
        statuses.append(outcome_status(outcome))
        results.scheduled.append(outcome.num_scheduled_tokens if ok else 0)
        results.computed.append(outcome.num_computed_tokens)
        results.cached.append(outcome.num_cached_tokens)
        for ids in outcome.new_block_ids:
            results.num_new_blocks.append(len(ids))
            results.new_block_ids.extend(ids)
        results.num_null_blocks.extend(outcome.num_null_blocks)
        results.freed.append(0)
        if ok and columns.types[i] == _ALLOCATE:
            counters.allocate_ok += 1
    counters.allocate_no_space += _count(statuses, STATUS_NO_SPACE)
    return results


def _apply_plain(cache: Any, columns: StepColumns, counters: Any) -> StepResults:
    types = columns.types
    n = len(types)
    starts = columns.starts
    lookahead = columns.num_lookahead_tokens
    rejected = columns.num_rejected_tokens
    request_ids = columns.request_ids
    counts = columns.num_token_ids
    new_tokens = columns.num_new_tokens
    out = RunningColumns(n)
    # Sparse per-operation values of the operations that did not go through
    # allocate_running (first calls, frees, speculative steps).
    scheduled_of: dict[int, int] = {}
    cached_of: dict[int, int] = {}
    freed_of: dict[int, int] = {}
    pos = 0
    i = 0
    # An engine's decode Step is one run of running-request allocations: found here with
    # a native scan of each column (the helpers above) instead of the loop below's
    # per-operation tests (~6 us for 256 operations); any other Step takes the loop.
    whole_run = (
        not starts
        and _count(types, _ALLOCATE) == n
        and _none_empty(request_ids)
        and _all_zero(lookahead)
        and _all_zero(rejected)
    )
    while i < n:
        j = n if whole_run else i
        while (
            j < n
            and types[j] == _ALLOCATE
            and request_ids[j]
            and not lookahead[j]
            and not rejected[j]
            and (not starts or j not in starts)
        ):
            j += 1
        if j > i:
            pos = cache.allocate_running(
                request_ids,
                columns.token_ids,
                counts,
                new_tokens,
                i,
                j,
                pos,
                out,
                columns.num_in_flight_tokens,
            )
            i = j
            continue
        count = counts[i]
        try:
            pos, outcome = _apply_one(cache, columns, i, pos, counters)
        except KvsvcError as exc:
            pos += count
            out.errors[i] = exc
            out.ok[i] = False
            out.num_computed_tokens[i] = 0
            out.new_block_ids[i] = out.EMPTY
            i += 1
            continue
        if isinstance(outcome, int):
            freed_of[i] = outcome
            out.ok[i] = True
            out.num_computed_tokens[i] = 0
            out.new_block_ids[i] = out.EMPTY
        else:
            scheduled_of[i] = outcome.num_scheduled_tokens if outcome.ok else 0
            cached_of[i] = outcome.num_cached_tokens
            if outcome.recompute:
                out.recompute.append(i)
            out.ok[i] = outcome.ok
            out.num_computed_tokens[i] = outcome.num_computed_tokens
            out.new_block_ids[i] = outcome.new_block_ids[0]
        i += 1

    results = StepResults(1)
    ok = out.ok
    # Every operation succeeded (an error or a recompute is never ok): the columns are
    # built in C and the counts below known without a scan (each ~8k instructions for
    # 256 operations).
    all_ok = _all_set(ok)
    if not all_ok:
        statuses = [STATUS_OK if flag else STATUS_NO_SPACE for flag in ok]
        scheduled = [count if flag else 0 for count, flag in zip(new_tokens, ok, strict=True)]
    else:
        statuses = [STATUS_OK] * n
        scheduled = list(new_tokens)
    results.statuses = statuses
    results.scheduled = scheduled
    results.computed = out.num_computed_tokens
    blocks = out.new_block_ids
    results.num_new_blocks = [len(ids) for ids in blocks]
    results.new_block_ids = [block for ids in blocks if ids for block in ids]
    results.num_null_blocks = [0] * n
    results.cached = cached = [0] * n
    results.freed = freed = [0] * n
    for index, value in scheduled_of.items():
        scheduled[index] = value
    for index, value in cached_of.items():
        cached[index] = value
    for index, value in freed_of.items():
        freed[index] = value
        scheduled[index] = 0
    for index in out.recompute:
        statuses[index] = STATUS_RECOMPUTE
    for index, error in out.errors.items():
        statuses[index] = STATUS_REJECTED
        scheduled[index] = 0
        results.errors[index] = kvcache_pb2.StepError(
            code=status_for(error).value[0], message=str(error)
        )
    # A lookup or a cache is OK without being an allocation; a whole run has neither.
    not_allocations = 0 if whole_run else _count(types, _LOOKUP) + _count(types, _CACHE)
    if all_ok:
        counters.allocate_ok += n - len(freed_of) - not_allocations
    else:
        counters.allocate_ok += _count(statuses, STATUS_OK) - len(freed_of) - not_allocations
        counters.allocate_no_space += _count(statuses, STATUS_NO_SPACE)
    return results
