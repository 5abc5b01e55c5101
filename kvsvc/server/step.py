"""Applying a Step: the hot path of the whole service.

An engine sends one Step per scheduling step, typically a decode token for each of a few
hundred running requests. Everything here is arranged so that the per-operation cost is
the core's own work plus a handful of list appends: columns are plain lists, bound
methods and constants are locals, single-group pools skip the per-group loops, and the
outcome counters are taken from the result columns in bulk at the end.
"""

from __future__ import annotations

from typing import Any

from kvsvc.errors import InvalidArgument, KvsvcError
from kvsvc.server.errors import status_for
from kvsvc.server.wire import (
    STATUS_NO_SPACE,
    STATUS_OK,
    StepColumns,
    StepResults,
    check_request_id,
    start_from_pb,
)
from kvsvc.v1 import kvcache_pb2

_ALLOCATE = kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE
_FREE = kvcache_pb2.STEP_OPERATION_TYPE_FREE
_PREEMPT = kvcache_pb2.STEP_OPERATION_TYPE_PREEMPT


def apply_step(cache: Any, columns: StepColumns, counters: Any) -> StepResults:
    """Apply the operations in order; an invalid one is rejected alone (no change)."""
    num_groups = cache.num_groups
    results = StepResults(num_groups)
    statuses = results.statuses
    scheduled = results.scheduled
    computed = results.computed
    cached = results.cached
    num_new_blocks = results.num_new_blocks
    new_block_ids = results.new_block_ids
    num_null_blocks = results.num_null_blocks
    freed_column = results.freed
    allocate = cache.allocate
    token_ids = columns.token_ids
    counts = columns.num_token_ids
    new_tokens = columns.num_new_tokens
    lookahead = columns.num_lookahead_tokens
    rejected = columns.num_rejected_tokens
    request_ids = columns.request_ids
    starts = columns.starts
    single_group = num_groups == 1
    num_frees = 0
    pos = 0
    for i, kind in enumerate(columns.types):
        count = counts[i]
        request_id = request_ids[i]
        try:
            if kind == _ALLOCATE:
                tokens = token_ids[pos : pos + count] if count else ()
                pos += count
                if not request_id:
                    raise InvalidArgument(f"request_ids[{i}]", "must not be empty")
                start = starts.get(i) if starts else None
                if start is not None:
                    start = start_from_pb(start, f"starts[{i}]")
                outcome = (
                    allocate(
                        request_id,
                        tokens,
                        new_tokens[i],
                        lookahead[i],
                        start,
                        num_rejected_tokens=rejected[i],
                    )
                    if rejected[i]
                    else allocate(request_id, tokens, new_tokens[i], lookahead[i], start)
                )
                ok = outcome.ok
                statuses.append(STATUS_OK if ok else STATUS_NO_SPACE)
                scheduled.append(outcome.num_scheduled_tokens if ok else 0)
                computed.append(outcome.num_computed_tokens)
                cached.append(outcome.num_cached_tokens)
                if single_group:
                    ids = outcome.new_block_ids[0]
                    num_new_blocks.append(len(ids))
                    if ids:
                        new_block_ids.extend(ids)
                    num_null_blocks.append(outcome.num_null_blocks[0])
                else:
                    for ids in outcome.new_block_ids:
                        num_new_blocks.append(len(ids))
                        if ids:
                            new_block_ids.extend(ids)
                    num_null_blocks.extend(outcome.num_null_blocks)
                freed_column.append(0)
            elif kind in (_FREE, _PREEMPT):
                pos += count
                check_request_id(request_id, f"request_ids[{i}]")
                if count or new_tokens[i] or lookahead[i] or rejected[i] or i in starts:
                    raise InvalidArgument(
                        f"types[{i}]", "a free carries no tokens, counts or start"
                    )
                preempted = kind == _PREEMPT
                freed = cache.free((request_id,), preempted=preempted)
                if preempted:
                    counters.preempt_requests += 1
                else:
                    counters.free_requests += 1
                counters.freed_blocks += freed
                results.add_free(freed)
                num_frees += 1
            else:
                pos += count
                raise InvalidArgument(f"types[{i}]", f"unknown operation type {kind}")
        except KvsvcError as exc:
            results.add_error(i, status_for(exc).value[0], str(exc))
    # Frees also report OK; allocations are the rest.
    counters.allocate_ok += statuses.count(STATUS_OK) - num_frees
    counters.allocate_no_space += statuses.count(STATUS_NO_SPACE)
    return results
