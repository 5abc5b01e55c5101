"""Request building and response parsing shared by the sync and asyncio clients."""

from __future__ import annotations

import array
import itertools
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from kvsvc.v1 import admin_pb2, kvcache_pb2, pools_pb2
from kvsvc.wire.packed import packed_one_byte_field, packed_varint_tags
from kvsvc_client._types import (
    AllBlocksCleared,
    AllocateResult,
    AllocateStatus,
    BlockRemoved,
    BlockStored,
    BlockTable,
    EventBatch,
    FreeResult,
    HashingContext,
    KVEvent,
    LookupResult,
    OperationError,
    PoolInfo,
    RequestStart,
    StepOutcome,
    Usage,
    WorkerInfo,
)
from kvsvc_client.errors import InvalidArgumentError, error_from_rpc

_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_STATE_NAMES = {
    value: name.removeprefix("POOL_STATE_") for name, value in pools_pb2.PoolState.items()
}


_STATUS = {
    kvcache_pb2.ALLOCATE_STATUS_OK: AllocateStatus.OK,
    kvcache_pb2.ALLOCATE_STATUS_NO_SPACE: AllocateStatus.NO_SPACE,
    kvcache_pb2.ALLOCATE_STATUS_RECOMPUTE: AllocateStatus.RECOMPUTE,
}

# Prompts longer than this travel packed (4 bytes per id): building and parsing a repeated
# varint field costs ~50 ns per id on each side, packing a few ns.
PACK_THRESHOLD = 16

# Operations or results a repr shows before "... N more": a step of hundreds of decodes
# printed in a REPL or a log line should stay one readable line.
REPR_ITEMS = 8

_OPERATION_NAMES: dict[int, str] = {
    kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE: "allocate",
    kvcache_pb2.STEP_OPERATION_TYPE_LOOKUP: "lookup",
    kvcache_pb2.STEP_OPERATION_TYPE_FREE: "free",
    kvcache_pb2.STEP_OPERATION_TYPE_PREEMPT: "preempt",
    kvcache_pb2.STEP_OPERATION_TYPE_CACHE: "cache",
}


def _bounded(items: list[str], total: int) -> str:
    more = total - len(items)
    return ", ".join(items + ([f"... {more} more"] if more > 0 else []))


def pack_token_ids(token_ids: Sequence[int]) -> bytes | None:
    """Little-endian 32-bit packing of the ids, or None when short or not packable.

    Ids that do not fit (negative, >= 2**32, not ints) are left to the repeated field,
    which refuses them too (:func:`extend_token_ids`).
    """
    if len(token_ids) < PACK_THRESHOLD:
        return None
    try:
        if type(token_ids) is list:
            # A list's own conversion is ~30% quicker than the constructor's iteration.
            values = array.array("I")
            values.fromlist(token_ids)
        else:
            values = array.array("I", token_ids)
    except (OverflowError, TypeError):
        return None
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


# The server's bound on token ids (its INVALID_ARGUMENT names the field and the first id
# at or above it); the wire's uint32 fields cannot carry ids outside [0, 2**32) at all.
MAX_TOKEN_ID_EXCLUSIVE = 2**31


def extend_token_ids(repeated: Any, token_ids: Sequence[int], field: str) -> None:
    """Append ``token_ids`` to a repeated uint32 field.

    Ids the field cannot hold (negative, >= 2**32, not ints) never reach the server, so
    they are refused here as the server refuses ids >= 2**31: an InvalidArgumentError
    naming the field, the first bad id and its index. Nothing is sent.
    """
    try:
        repeated.extend(token_ids)
    except (ValueError, TypeError):
        for i, token in enumerate(token_ids):
            if not isinstance(token, int) or not 0 <= token < MAX_TOKEN_ID_EXCLUSIVE:
                raise InvalidArgumentError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{field}: token ids must be integers in [0, {MAX_TOKEN_ID_EXCLUSIVE}); "
                    f"[{i}] is {token!r}",
                ) from None
        raise


def hashing_to_pb(hashing: HashingContext | None) -> kvcache_pb2.HashingContext | None:
    if hashing is None:
        return None
    return kvcache_pb2.HashingContext(
        cache_salt=hashing.cache_salt,
        lora_name=hashing.lora_name,
        lora_path=hashing.lora_path,
        mm_items=[
            kvcache_pb2.MultiModalItem(identifier=i.identifier, offset=i.offset, length=i.length)
            for i in hashing.mm_items
        ],
        prompt_embeds_digests=hashing.prompt_embeds_digests,
        lora_id=hashing.lora_id,
    )


def start_to_pb(start: RequestStart | bool) -> kvcache_pb2.RequestStart | None:
    if start is False:
        return None
    if start is True:
        return kvcache_pb2.RequestStart()
    return kvcache_pb2.RequestStart(
        hashing=hashing_to_pb(start.hashing),
        skip_prefix_cache_read=start.skip_prefix_cache_read,
        resumed=start.resumed,
        num_encoder_tokens=start.num_encoder_tokens,
        num_prompt_tokens=start.num_prompt_tokens,
        max_cache_hit_tokens=start.max_cache_hit_tokens,
        num_draft_tokens=start.num_draft_tokens,
    )


def allocate_request(
    pool: str,
    request_id: str,
    new_token_ids: Sequence[int],
    num_new_tokens: int,
    num_lookahead_tokens: int,
    start: RequestStart | bool,
) -> kvcache_pb2.AllocateRequest:
    request = kvcache_pb2.AllocateRequest(
        pool=pool,
        request_id=request_id,
        num_new_tokens=num_new_tokens,
        num_lookahead_tokens=num_lookahead_tokens,
    )
    packed = pack_token_ids(new_token_ids)
    if packed is not None:
        request.packed_new_token_ids = packed
    else:
        extend_token_ids(request.new_token_ids, new_token_ids, "new_token_ids")
    start_pb = start_to_pb(start)
    if start_pb is not None:
        request.start.CopyFrom(start_pb)
    return request


def free_request(pool: str, request_ids: Sequence[str], preempted: bool) -> kvcache_pb2.FreeRequest:
    reason = kvcache_pb2.FREE_REASON_PREEMPTED if preempted else kvcache_pb2.FREE_REASON_FINISHED
    return kvcache_pb2.FreeRequest(pool=pool, request_ids=request_ids, reason=reason)


def lookup_request(
    pool: str, token_ids: Sequence[int], hashing: HashingContext | None
) -> kvcache_pb2.LookupRequest:
    request = kvcache_pb2.LookupRequest(pool=pool, hashing=hashing_to_pb(hashing))
    packed = pack_token_ids(token_ids)
    if packed is not None:
        request.packed_token_ids = packed
    else:
        extend_token_ids(request.token_ids, token_ids, "token_ids")
    return request


def allocate_result(response: kvcache_pb2.AllocateResponse) -> AllocateResult:
    return AllocateResult(
        status=_STATUS.get(response.status, AllocateStatus.NO_SPACE),
        new_block_ids=tuple(tuple(g.block_ids) for g in response.new_blocks),
        num_null_blocks=tuple(g.num_null_blocks for g in response.new_blocks),
        num_cached_tokens=response.num_cached_tokens,
        num_scheduled_tokens=response.num_scheduled_tokens,
        num_computed_tokens=response.num_computed_tokens,
    )


_STEP_REQUEST_TAGS = packed_varint_tags(kvcache_pb2.StepRequest)


def _indices_of(values: list[int], value: int) -> list[int]:
    """The positions of ``value`` in ``values``, found by ``list.index`` (in C): a decode
    step's reply has none or a few, and a scan in Python costs ~30 ns an operation."""
    found: list[int] = []
    if value not in values:
        return found
    i = values.index(value)
    try:
        while True:
            found.append(i)
            i = values.index(value, i + 1)
    except ValueError:
        return found


class StepBuilder:
    """Collects one scheduling step's operations; ``send()`` applies them in order.

    Operations are encoded column-wise (see ``StepRequest`` in kvcache.proto); results come
    back in the same order, one per operation.

    Attributes:
        free_queue_head_limit: ask the reply for this many ids from the front of the
            pool's free queue after the batch (``StepResultList.free_queue_head``).
        free_queue_head_offset: with ``free_queue_head_limit``, skip this many ids of
            the queue's front first (to read a large queue page by page, in order, with
            Steps that carry no operations: each page starts where the last one ended).
    """

    def __init__(self, pool: str) -> None:
        self._pool = pool
        self._types: list[int] = []
        self._ids: list[str] = []
        self._counts: list[int] = []
        self._tokens: list[int] = []
        self._new: list[int] = []
        self._lookahead: list[int] = []
        self._rejected: list[int] = []
        self._in_flight: list[int] = []
        # Whether any operation set a lookahead, rejected or in-flight count (a decode
        # step's are all 0: its Step then sends none of the three columns).
        self._extras = False
        self._starts: dict[int, kvcache_pb2.RequestStart] = {}
        self.free_queue_head_limit = 0
        self.free_queue_head_offset = 0

    def __len__(self) -> int:
        return len(self._types)

    def __repr__(self) -> str:
        ops = [
            _OPERATION_NAMES.get(kind, str(kind))
            + (f" {request_id!r}" if request_id else f" {count} tokens")
            for kind, request_id, count in zip(
                self._types[:REPR_ITEMS], self._ids, self._counts, strict=False
            )
        ]
        return f"{type(self).__name__}(pool={self._pool!r}, [{_bounded(ops, len(self))}])"

    def allocate(
        self,
        request_id: str,
        new_token_ids: Sequence[int] = (),
        num_new_tokens: int = 0,
        *,
        num_lookahead_tokens: int = 0,
        start: RequestStart | bool = False,
        num_rejected_tokens: int = 0,
        num_in_flight_tokens: int = 0,
    ) -> StepBuilder:
        """Add an allocation (``start`` on a request's first call, as for ``allocate``;
        ``num_rejected_tokens``: drafts of the last step that were rejected;
        ``num_in_flight_tokens``: computed tokens of earlier steps whose outputs have not
        come back, for an engine that schedules ahead)."""
        if start is not False:
            start_pb = start_to_pb(start)
            if start_pb is not None:
                self._starts[len(self._types)] = start_pb
        if num_lookahead_tokens or num_rejected_tokens or num_in_flight_tokens:
            self._extras = True
        self._types.append(kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE)
        self._ids.append(request_id)
        self._counts.append(len(new_token_ids))
        self._tokens.extend(new_token_ids)
        self._new.append(num_new_tokens)
        self._lookahead.append(num_lookahead_tokens)
        self._rejected.append(num_rejected_tokens)
        self._in_flight.append(num_in_flight_tokens)
        return self

    def cache(
        self,
        request_id: str,
        new_token_ids: Sequence[int] = (),
        *,
        num_rejected_tokens: int = 0,
        num_in_flight_tokens: int = 0,
    ) -> StepBuilder:
        """Add the arrival of a running request's outputs after its slots were allocated
        (an engine that schedules ahead, or speculates): the server appends them, takes
        ``num_rejected_tokens`` off its computed count and caches the blocks that are full
        up to computed - ``num_in_flight_tokens``. Allocates nothing (vLLM's
        ``cache_blocks``)."""
        if num_rejected_tokens or num_in_flight_tokens:
            self._extras = True
        self._types.append(kvcache_pb2.STEP_OPERATION_TYPE_CACHE)
        self._ids.append(request_id)
        self._counts.append(len(new_token_ids))
        self._tokens.extend(new_token_ids)
        self._new.append(0)
        self._lookahead.append(0)
        self._rejected.append(num_rejected_tokens)
        self._in_flight.append(num_in_flight_tokens)
        return self

    def lookup(
        self, token_ids: Sequence[int], hashing: HashingContext | None = None
    ) -> StepBuilder:
        """Add a lookup: the hit an admission of ``token_ids`` would get after the
        operations before it (changes nothing; its result is a :class:`LookupResult`)."""
        hashing_pb = hashing_to_pb(hashing)
        if hashing_pb is not None:
            self._starts[len(self._types)] = kvcache_pb2.RequestStart(hashing=hashing_pb)
        self._types.append(kvcache_pb2.STEP_OPERATION_TYPE_LOOKUP)
        self._ids.append("")
        self._counts.append(len(token_ids))
        self._tokens.extend(token_ids)
        self._new.append(0)
        self._lookahead.append(0)
        self._rejected.append(0)
        self._in_flight.append(0)
        return self

    def free(self, request_id: str) -> StepBuilder:
        """Add the release of a finished request."""
        return self._release(request_id, kvcache_pb2.STEP_OPERATION_TYPE_FREE)

    def preempt(self, request_id: str) -> StepBuilder:
        """Add the release of a preempted request (it comes back with a first call)."""
        return self._release(request_id, kvcache_pb2.STEP_OPERATION_TYPE_PREEMPT)

    def _release(self, request_id: str, kind: int) -> StepBuilder:
        self._types.append(kind)
        self._ids.append(request_id)
        self._counts.append(0)
        self._new.append(0)
        self._lookahead.append(0)
        self._rejected.append(0)
        self._in_flight.append(0)
        return self

    def to_pb(self) -> kvcache_pb2.StepRequest:
        packed = pack_token_ids(self._tokens)
        extras = self._extras
        # A decode step's types and counts are 1s: such columns go in as their wire bytes
        # (one byte a value, parsed in C), not element by element (~15 ns each).
        columns: dict[str, list[int]] = {}
        encoded: list[bytes] = []
        for name, values in (
            ("types", self._types),
            ("num_token_ids", self._counts),
            ("num_new_tokens", self._new),
        ):
            field = packed_one_byte_field(_STEP_REQUEST_TAGS[name], values)
            if field is None:
                columns[name] = values
            else:
                encoded.append(field)
        request = kvcache_pb2.StepRequest(
            pool=self._pool,
            request_ids=self._ids,
            packed_token_ids=packed or b"",
            num_lookahead_tokens=self._lookahead if extras and any(self._lookahead) else (),
            num_rejected_tokens=self._rejected if extras and any(self._rejected) else (),
            num_in_flight_tokens=self._in_flight if extras and any(self._in_flight) else (),
            starts=self._starts,
            free_queue_head_limit=self.free_queue_head_limit,
            free_queue_head_offset=self.free_queue_head_offset,
            **columns,  # type: ignore[arg-type]
        )
        if encoded:
            request.MergeFromString(b"".join(encoded))
        if packed is None:
            extend_token_ids(request.token_ids, self._tokens, "token_ids")
        return request

    def parse(self, response: kvcache_pb2.StepResponse) -> StepResultList:
        return StepResultList(self._types, response)


class StepResultList(Sequence[StepOutcome]):
    """The results of a Step, one per operation, decoded on access.

    A decode step of a few hundred requests mostly needs to know which ones got
    ``NO_SPACE`` and which got new blocks; decoding every result eagerly would cost more
    than the server's work. A response column is copied into a list the first time it is
    needed; an operation's result object is built when it is indexed.
    """

    def __init__(self, types: Sequence[int], response: kvcache_pb2.StepResponse) -> None:
        if len(response.statuses) != len(types):
            raise RuntimeError(
                f"server returned {len(response.statuses)} results for {len(types)} operations"
            )
        self._types = types
        self._response = response
        self._groups = response.num_groups
        self._columns: dict[str, list[Any]] = {}
        self._offsets: list[int] | None = None

    def _column(self, name: str) -> list[Any]:
        """A response column as a list, converted on first use."""
        column = self._columns.get(name)
        if column is None:
            column = self._columns[name] = list(getattr(self._response, name))
        return column

    def __len__(self) -> int:
        return len(self._types)

    def __repr__(self) -> str:
        shown = [repr(self[i]) for i in range(min(len(self), REPR_ITEMS))]
        return (
            f"StepResultList([{_bounded(shown, len(self))}], "
            f"num_free_blocks={self.num_free_blocks})"
        )

    @property
    def response(self) -> kvcache_pb2.StepResponse:
        """The raw reply, for callers that read whole columns."""
        return self._response

    @property
    def free_queue_head(self) -> list[int]:
        """The front of the pool's free queue after the batch, if it was asked for."""
        return list(self._response.free_queue_head)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the pool after the batch (cached ones included)."""
        return self._response.num_free_blocks

    @property
    def statuses(self) -> list[int]:
        """Raw per-operation status codes (kvsvc.v1.AllocateStatus values)."""
        return self._column("statuses")

    def no_space_indices(self) -> list[int]:
        """Indices of the allocations that got NO_SPACE."""
        return _indices_of(self.statuses, kvcache_pb2.ALLOCATE_STATUS_NO_SPACE)

    def recompute_indices(self) -> list[int]:
        """Indices of the allocations whose request must be recomputed (RECOMPUTE): free
        each as preempted and admit it again."""
        recompute = kvcache_pb2.ALLOCATE_STATUS_RECOMPUTE
        return [i for i, status in enumerate(self.statuses) if status == recompute]

    def error_indices(self) -> list[int]:
        return sorted(self._response.errors)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        errors = self._response.errors
        error = errors.get(index)
        if error is not None:
            return OperationError(
                _CODE_BY_VALUE.get(error.code, grpc.StatusCode.UNKNOWN), error.message
            )
        column = self._column
        kind = self._types[index]
        if kind in (kvcache_pb2.STEP_OPERATION_TYPE_FREE, kvcache_pb2.STEP_OPERATION_TYPE_PREEMPT):
            return FreeResult(column("num_freed_blocks")[index])
        counts = column("num_new_blocks")
        if self._offsets is None:
            self._offsets = [0, *itertools.accumulate(counts)]
        block_ids = column("new_block_ids")
        groups = self._groups
        base = index * groups
        pos = self._offsets[base]
        per_group = []
        for count in counts[base : base + groups]:
            per_group.append(tuple(block_ids[pos : pos + count]))
            pos += count
        if kind == kvcache_pb2.STEP_OPERATION_TYPE_LOOKUP:
            return LookupResult(column("num_cached_tokens")[index], tuple(per_group))
        return AllocateResult(
            status=_STATUS.get(column("statuses")[index], AllocateStatus.NO_SPACE),
            new_block_ids=tuple(per_group),
            num_null_blocks=tuple(column("num_null_blocks")[base : base + groups]),
            num_cached_tokens=column("num_cached_tokens")[index],
            num_scheduled_tokens=column("num_scheduled_tokens")[index],
            num_computed_tokens=column("num_computed_tokens")[index],
        )


def block_table(response: kvcache_pb2.GetBlockTableResponse) -> BlockTable:
    return BlockTable(
        needs_recompute=response.needs_recompute,
        groups=tuple(tuple(g.block_ids) for g in response.groups),
        num_computed_tokens=response.num_computed_tokens,
        num_tokens=response.num_tokens,
    )


def usage(response: kvcache_pb2.GetUsageResponse) -> Usage:
    stats = response.prefix_cache
    return Usage(
        pool=response.pool,
        num_blocks=response.num_blocks,
        num_free_blocks=response.num_free_blocks,
        usage=response.usage,
        num_requests=response.num_requests,
        num_cached_blocks=response.num_cached_blocks,
        prefix_cache_queries=stats.queries,
        prefix_cache_hits=stats.hits,
        preempted_queries=stats.preempted_queries,
        preempted_hits=stats.preempted_hits,
        num_evictions=response.num_evictions,
        block_size=response.block_size,
        kv_cache_capacity_tokens=response.kv_cache_capacity_tokens,
        num_requests_needing_recompute=response.num_requests_needing_recompute,
        num_invalidations=response.num_invalidations,
    )


def _event(event: kvcache_pb2.KVEvent) -> KVEvent:
    kind = event.WhichOneof("event")
    if kind == "stored":
        s = event.stored
        return BlockStored(
            block_hashes=tuple(s.block_hashes),
            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
            token_ids=tuple(s.token_ids),
            block_size=s.block_size,
            lora_name=s.lora_name,
            medium=s.medium,
            group_index=s.group_index,
            group_kind=s.group_kind,
            lora_id=s.lora_id,
        )
    if kind == "removed":
        r = event.removed
        return BlockRemoved(
            block_hashes=tuple(r.block_hashes), medium=r.medium, group_index=r.group_index
        )
    return AllBlocksCleared()


def event_batch(response: kvcache_pb2.WatchEventsResponse) -> EventBatch:
    return EventBatch(
        sequence=response.sequence,
        timestamp=response.timestamp,
        events=tuple(_event(e) for e in response.events),
        epoch=response.epoch,
        gap=response.gap,
        oldest_available_sequence=response.oldest_available_sequence,
        caught_up=response.caught_up,
    )


def resume_sequence(batch: EventBatch) -> int:
    """Where a stream that ended after ``batch`` resumes: after a batch, the next one; after
    a marker (gap or caught_up: sequence 0), the batch it names."""
    if batch.gap or batch.caught_up:
        return batch.oldest_available_sequence
    return batch.sequence + 1


def pool_info(summary: admin_pb2.PoolSummary) -> PoolInfo:
    return PoolInfo(
        name=summary.name,
        state=_STATE_NAMES.get(summary.state, "UNSPECIFIED"),
        world_size=summary.world_size,
        num_registered=summary.num_registered,
        block_size=summary.block_size,
        num_blocks=summary.num_blocks,
        hash_algo=summary.hash_algo,
        enable_prefix_caching=summary.enable_prefix_caching,
        error=summary.error,
        max_model_len=summary.max_model_len,
        epoch=summary.epoch,
        persistent=summary.persistent,
        prefix_cache_retention_interval=summary.prefix_cache_retention_interval,
        workers=tuple(
            WorkerInfo(
                rank=w.rank,
                device=w.device,
                hostname=w.hostname,
                registered=w.registered,
                allocated=w.allocated,
                heartbeat_age_seconds=w.heartbeat_age_seconds,
                kv_cache_bytes=w.kv_cache_bytes,
                memory_free_bytes=w.memory_free_bytes,
                connected=w.connected,
                live=w.live,
                in_engine=w.in_engine,
            )
            for w in summary.workers
        ),
    )


def raise_from(exc: grpc.RpcError) -> Any:
    raise error_from_rpc(exc) from None
