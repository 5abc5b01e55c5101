"""The engine calls that change a pool, as plain functions the servicers and the journal
replay share.

A call is decoded (shape checked, ids put in the engine's namespace) and then applied to
the pool's core under its lock. A restarting server replays its journal through exactly
these functions, from the requests as they came over the wire, so a replayed call does
what the served one did; its reply is rebuilt too, and must match the digest the journal
kept of the reply the caller got (see :mod:`kvsvc.server.persistence`).

Also here: the :class:`CallLog` of recent replies by ``call_id``, which answers a retried
call (its reply was lost, e.g. in a restart) without applying it twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from google.protobuf.message import DecodeError, Message

from kvsvc.core import AllocateOutcome, RequestStart
from kvsvc.errors import InvalidArgument, quoted
from kvsvc.server.namespace import NAMESPACE_SEPARATOR, scoped_request_id, unscope_message
from kvsvc.server.persistence.records import JournalKind
from kvsvc.server.persistence.writer import replay_units
from kvsvc.server.step import apply_step, changed_the_pool
from kvsvc.server.wire import (
    StepColumns,
    allocate_reply_bytes,
    allocate_response,
    check_request_id,
    start_from_pb,
    token_ids_of,
)
from kvsvc.v1 import kvcache_pb2

# Replies remembered for retries by call_id (the last ones; a retry comes soon), per
# caller (engine namespace): its last calls, within its bytes; and the bytes of a pool's.
CALL_LOG_CAPACITY = 1024
CALL_LOG_CALLER_BYTES = 4 << 20
CALL_LOG_POOL_BYTES = 32 << 20
CALL_LOG_ENTRY_OVERHEAD = 200
MAX_CALL_ID_BYTES = 128
_FREE_REASONS = frozenset(kvcache_pb2.FreeReason.values())


def check_call_id(call_id: str) -> None:
    if len(call_id) > MAX_CALL_ID_BYTES // 4 and len(call_id.encode()) > MAX_CALL_ID_BYTES:
        raise InvalidArgument("call_id", f"longer than {MAX_CALL_ID_BYTES} bytes (UTF-8)")


@dataclass(slots=True)
class AllocateCall:
    """A decoded Allocate."""

    request_id: str
    tokens: Sequence[int]
    num_new_tokens: int
    num_lookahead_tokens: int
    start: RequestStart | None
    num_rejected_tokens: int
    packed: bytes | None
    num_in_flight_tokens: int = 0


def decode_allocate(request: Any, engine: str) -> AllocateCall:
    """Raises InvalidArgument (nothing applied)."""
    check_request_id(request.request_id)
    return AllocateCall(
        request_id=scoped_request_id(request.request_id, engine),
        tokens=token_ids_of(
            request.new_token_ids,
            request.packed_new_token_ids,
            "new_token_ids",
            "packed_new_token_ids",
        ),
        num_new_tokens=request.num_new_tokens,
        num_lookahead_tokens=request.num_lookahead_tokens,
        start=start_from_pb(request.start, "start") if request.HasField("start") else None,
        num_rejected_tokens=request.num_rejected_tokens,
        packed=request.packed_new_token_ids or None,
        num_in_flight_tokens=request.num_in_flight_tokens,
    )


def apply_allocate(cache: Any, call: AllocateCall) -> tuple[Any, bool, AllocateOutcome]:
    """Returns the reply, whether the pool changed, and the outcome."""
    outcome: AllocateOutcome = cache.allocate(
        call.request_id,
        call.tokens,
        call.num_new_tokens,
        call.num_lookahead_tokens,
        call.start,
        num_rejected_tokens=call.num_rejected_tokens,
        packed_token_ids=call.packed,
        num_in_flight_tokens=call.num_in_flight_tokens,
    )
    data = allocate_reply_bytes(outcome)
    reply = allocate_response(outcome) if data is None else AllocateReply(data)
    return reply, outcome.ok or outcome.released, outcome


@dataclass(frozen=True)
class FreeCall:
    """A decoded Free: the ids (in the engine's namespace), whether they were preempted,
    and, for ``needing_recompute``, the engine whose flagged requests it frees (the ids
    are then found when it is applied, under the pool's lock)."""

    ids: list[str]
    preempted: bool
    needing_recompute: bool = False
    engine: str = ""


def decode_free(request: Any, engine: str) -> FreeCall:
    """Raises:
    InvalidArgument: a bad id, an id listed twice, an unknown reason, ids beside
    ``needing_recompute``.
    """
    ids = list(request.request_ids)
    for i, request_id in enumerate(ids):
        check_request_id(request_id, f"request_ids[{i}]")
    if len(set(ids)) != len(ids):
        raise InvalidArgument("request_ids", "lists a request more than once")
    if request.needing_recompute and ids:
        raise InvalidArgument(
            "request_ids",
            "must be empty with needing_recompute (it frees every request of the caller "
            "that needs recompute)",
        )
    if engine:
        ids = [scoped_request_id(request_id, engine) for request_id in ids]
    if request.reason not in _FREE_REASONS:
        raise InvalidArgument(
            "reason",
            f"unknown FreeReason {request.reason}; valid: "
            + ", ".join(f"{name}={value}" for name, value in kvcache_pb2.FreeReason.items()),
        )
    return FreeCall(
        ids,
        request.reason == kvcache_pb2.FREE_REASON_PREEMPTED,
        request.needing_recompute,
        engine,
    )


def _flagged_of(cache: Any, engine: str) -> list[str]:
    """The live requests of ``engine``'s namespace that need recompute (the default
    namespace's are the ids without an engine prefix)."""
    if engine:
        return cache.requests_needing_recompute(f"{engine}{NAMESPACE_SEPARATOR}")  # type: ignore[no-any-return]
    return [rid for rid in cache.requests_needing_recompute() if NAMESPACE_SEPARATOR not in rid]


def apply_free(cache: Any, call: FreeCall) -> tuple[Any, bool, int]:
    """Returns the reply, whether the pool changed (a live request was freed), and the
    blocks freed."""
    ids = _flagged_of(cache, call.engine) if call.needing_recompute else call.ids
    live_before = cache.num_requests
    freed: int = cache.free(ids, preempted=call.preempted)
    num_freed_requests = live_before - cache.num_requests
    return (
        kvcache_pb2.FreeResponse(num_freed_blocks=freed, num_freed_requests=num_freed_requests),
        num_freed_requests != 0,
        freed,
    )


def decode_step(request: Any, engine: str, max_operations: int) -> StepColumns:
    """Raises InvalidArgument (the whole Step is refused)."""
    columns = StepColumns(request, max_operations)
    if engine:
        columns.request_ids = [scoped_request_id(r, engine) for r in columns.sent_request_ids]
    return columns


def apply_step_call(
    cache: Any, columns: StepColumns, engine: str, counters: Any
) -> tuple[Any, bool]:
    """Returns the reply and whether the pool changed (an operation other than a lookup
    succeeded)."""
    results = apply_step(cache, columns, counters)
    if engine and results.errors:
        for error in results.errors.values():
            error.message = unscope_message(error.message, engine)
    changed = changed_the_pool(results.statuses, columns.types)
    data = results.to_bytes()
    reply = results.to_pb() if data is None else StepReply(data)
    return reply, changed or results.released


class WrittenReply:
    """A reply as the bytes the server wrote itself: what the transports send and the
    journal digests (``SerializeToString``), the same bytes protobuf writes of the message.
    The message itself is parsed only where something reads it (an in-process caller, a
    test): its fields are read through this object as from a message of ``MESSAGE``.
    """

    __slots__ = ("_data", "_message")

    MESSAGE: ClassVar[type[Message]]

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._message: Message | None = None

    def SerializeToString(self) -> bytes:
        """The reply's wire bytes."""
        return self._data

    @property
    def message(self) -> Any:
        """The reply as protobuf's message (parsed once, on first use)."""
        if self._message is None:
            self._message = self.MESSAGE.FromString(self._data)
        return self._message

    def __getattr__(self, name: str) -> Any:
        return getattr(self.message, name)

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._data == cast(WrittenReply, other)._data
        return bool(self.message == other)

    __hash__ = None  # type: ignore[assignment]  # as protobuf's messages: mutable, unhashable


class StepReply(WrittenReply):
    """A Step's reply as :meth:`StepResults.to_bytes` wrote it."""

    __slots__ = ()
    MESSAGE = kvcache_pb2.StepResponse


class AllocateReply(WrittenReply):
    """An Allocate's reply as :func:`~kvsvc.server.wire.allocate_reply_bytes` wrote it."""

    __slots__ = ()
    MESSAGE = kvcache_pb2.AllocateResponse


class _Counters:
    """Where a replayed call's outcome counts go: nowhere (metrics count served calls)."""

    def __getattr__(self, name: str) -> int:
        return 0

    def __setattr__(self, name: str, value: Any) -> None:
        pass


_REQUEST_TYPES: dict[int, type[Message]] = {
    JournalKind.ALLOCATE: kvcache_pb2.AllocateRequest,
    JournalKind.FREE: kvcache_pb2.FreeRequest,
    JournalKind.STEP: kvcache_pb2.StepRequest,
}


def parse_journaled(kind: int, payload: bytes) -> Any:
    """The request a journal row holds.

    Raises:
        ValueError: an unknown kind or a payload that does not parse.
    """
    return _parse_message(_REQUEST_TYPES, kind, payload, "journal row")


def _parse_message(types: dict[int, Any], kind: int, data: bytes, what: str) -> Any:
    """``data`` parsed as the message ``types`` gives for ``kind``.

    Raises:
        ValueError: an unknown kind or bytes that do not parse (the message names ``what``).
    """
    cls = types.get(kind)
    if cls is None:
        raise ValueError(f"{what} of unknown kind {kind}")
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise ValueError(f"{what} of kind {kind} does not parse: {exc}") from None


def journal_units(kind: int, request: Any) -> int:
    """What replaying the journal row of ``request`` (a call of ``kind``) costs, in the
    units the snapshot trigger counts (:func:`~kvsvc.server.persistence.writer.replay_units`):
    the same figure whether the call is being served or its row was just replayed."""
    if kind == JournalKind.ALLOCATE:
        return replay_units(1, len(request.new_token_ids) + len(request.packed_new_token_ids) // 4)
    if kind == JournalKind.FREE:
        return replay_units(max(1, len(request.request_ids)), 0)
    if kind == JournalKind.STEP:
        tokens = len(request.token_ids) + len(request.packed_token_ids) // 4
        return replay_units(len(request.types), tokens)
    return replay_units(1, 0)


def replay_call(cache: Any, kind: int, request: Any, engine: str) -> tuple[Any, bool]:
    """Apply a journaled engine call again (no bounds of the current config: it was
    accepted once). Returns the rebuilt reply and whether the pool changed."""
    if kind == JournalKind.ALLOCATE:
        response, changed, _ = apply_allocate(cache, decode_allocate(request, engine))
        return response, changed
    if kind == JournalKind.FREE:
        response, changed, _ = apply_free(cache, decode_free(request, engine))
        return response, changed
    if kind == JournalKind.STEP:
        columns = decode_step(request, engine, 1 << 30)
        return apply_step_call(cache, columns, engine, _Counters())
    raise ValueError(f"journal row of kind {kind} is no engine call")


class _EngineCalls:
    """One engine's kept calls: call id -> entry cost, oldest first, and their sum."""

    __slots__ = ("costs", "num_bytes")

    def __init__(self) -> None:
        self.costs: OrderedDict[str, int] = OrderedDict()
        self.num_bytes = 0


class CallLog:
    """Replies of the last calls that changed the pool and carried a ``call_id``, by
    (engine, call id): what a retry of such a call is answered from, so it is not applied
    twice.

    Only what a retry needs is kept: a call that changed nothing (a read-only Step, such
    as a free-queue page or zero operations; an admission that found no space) is not
    kept at all, because applying its repeat is the same as applying it once. Replies are
    kept serialized (parsed again only for a retry) and bounded per caller (its last
    ``per_caller_entries`` calls within ``per_caller_bytes``) and per pool
    (``pool_bytes``), counting each entry's ids and bookkeeping besides its reply: one
    engine's burst of calls with fresh ids evicts its own oldest entries, not the other
    engines'. A repeat of an evicted call is applied again (as a call the server never
    saw). The bounds hold for a snapshot too, which keeps exactly these entries.

    Each entry keeps the journal position of its call (0 when not persisted), so a
    retry is answered only once that position is durable, like the first attempt.
    """

    def __init__(
        self,
        per_caller_entries: int = CALL_LOG_CAPACITY,
        per_caller_bytes: int = CALL_LOG_CALLER_BYTES,
        pool_bytes: int = CALL_LOG_POOL_BYTES,
    ) -> None:
        self.per_caller_entries = per_caller_entries
        self.per_caller_bytes = per_caller_bytes
        self.pool_bytes = pool_bytes
        # (engine, call id) -> (kind, serialized reply, ticket); oldest first, overall and
        # within each engine's own log.
        self._entries: OrderedDict[tuple[str, str], tuple[int, bytes, int]] = OrderedDict()
        self._by_engine: dict[str, _EngineCalls] = {}  # only engines with an entry
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def engine_bytes(self, engine: str) -> int:
        """What ``engine``'s entries cost now (for tests and metrics)."""
        mine = self._by_engine.get(engine)
        return 0 if mine is None else mine.num_bytes

    def get(self, engine: str, call_id: str, kind: int) -> tuple[Any, int] | None:
        """The reply of that call (parsed anew) and its journal ticket, or None.

        Raises:
            InvalidArgument: the call id was used by a call of another kind.
        """
        entry = self._entries.get((engine, call_id))
        if entry is None:
            return None
        if entry[0] != kind:
            raise InvalidArgument(
                "call_id", f"{quoted(call_id)} was used by another kind of call; use a fresh id"
            )
        return _parse_reply(entry[0], entry[1]), entry[2]

    def put(self, engine: str, call_id: str, kind: int, reply: bytes, ticket: int) -> None:
        """Keep ``reply`` (serialized) of a call that changed the pool, evicting the
        caller's oldest entries past its bounds, then the pool's oldest past the pool's.
        A reply larger than a caller's whole budget is not kept.

        Every engine Step carries a call id, so this runs on every call, and once an
        engine's log is full each put evicts that engine's oldest entry: done here with
        one ``popitem`` rather than a general :meth:`_drop` (an engine's bytes are an
        attribute of its log, not a second dict's entry: 17.3k -> 13.4k instructions a put).
        """
        key = (engine, call_id)
        entries = self._entries
        if key in entries:
            self._drop(key)
        cost = entry_cost(engine, call_id, reply)
        if cost > self.per_caller_bytes or cost > self.pool_bytes:
            return
        mine = self._by_engine.get(engine)
        if mine is None:
            mine = self._by_engine[engine] = _EngineCalls()
        costs = mine.costs
        while costs and (
            len(costs) >= self.per_caller_entries or mine.num_bytes + cost > self.per_caller_bytes
        ):
            oldest, oldest_cost = costs.popitem(last=False)
            del entries[(engine, oldest)]
            mine.num_bytes -= oldest_cost
            self.num_bytes -= oldest_cost
        while entries and self.num_bytes + cost > self.pool_bytes:
            self._drop(next(iter(entries)))
        if engine not in self._by_engine:  # its last entry went in the pool's eviction
            self._by_engine[engine] = mine
        entries[key] = (kind, reply, ticket)
        costs[call_id] = cost
        mine.num_bytes += cost
        self.num_bytes += cost

    def _drop(self, key: tuple[str, str]) -> None:
        engine, call_id = key
        del self._entries[key]
        mine = self._by_engine[engine]
        cost = mine.costs.pop(call_id)
        mine.num_bytes -= cost
        self.num_bytes -= cost
        if not mine.costs:
            del self._by_engine[engine]

    def to_state(self) -> list[list[Any]]:
        """Plain values: ``[engine, call id, kind, serialized reply]`` oldest first."""
        return [
            [engine, call_id, kind, reply]
            for (engine, call_id), (kind, reply, _) in self._entries.items()
        ]

    def load_state(self, state: list[list[Any]]) -> None:
        """Take over :meth:`to_state` (replies durable already: ticket 0), within this
        log's bounds (a state saved under larger ones keeps its newest entries).

        Raises:
            ValueError: an entry of an unknown kind or a reply that does not parse.
        """
        self._entries.clear()
        self._by_engine.clear()
        self.num_bytes = 0
        for engine, call_id, kind, data in state:
            _parse_reply(kind, data)  # checked whole before it is served
            self.put(engine, call_id, kind, bytes(data), 0)


def entry_cost(engine: str, call_id: str, reply: bytes) -> int:
    """What one kept reply costs against the bounds: its bytes, its ids, and the
    bookkeeping of an entry (dict slots, a tuple, the ints: about 200 bytes)."""
    return len(reply) + len(engine) + 2 * len(call_id) + CALL_LOG_ENTRY_OVERHEAD


_REPLY_TYPES: dict[int, type[Message]] = {
    JournalKind.ALLOCATE: kvcache_pb2.AllocateResponse,
    JournalKind.FREE: kvcache_pb2.FreeResponse,
    JournalKind.STEP: kvcache_pb2.StepResponse,
}


def _parse_reply(kind: int, data: bytes) -> Any:
    return _parse_message(_REPLY_TYPES, kind, data, "a saved reply")
