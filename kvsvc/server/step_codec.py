"""Step requests read from their wire bytes, without a protobuf message object.

A decode Step of a few hundred requests is mostly columns: one id per operation and a
handful of packed counts. protobuf parses it in C, but then every column is copied into
Python element by element (``list(request.types)``, ``list(request.request_ids)``: ~15 ns
an element, ~40 us per 256-operation Step). Here the bytes are walked once (this module is
compiled by mypyc with the core) and the columns come out as the lists the handler wants.

**Exactly protobuf's message, or protobuf itself.** :func:`parse_step_request` reads the
encodings an ordinary encoder writes and protobuf accepts: each known field with its
declared wire type, in any order, repeated (a singular field's last value wins, a repeated
field's values concatenate), repeated scalars packed or not, varints of any length up to
five bytes (non-canonical ones too) whose value fits the field. Anything else (an unknown
field, a known field with another wire type, a longer varint, a negative or out-of-range
value, bytes that are not UTF-8 in a string, a truncated field) hands the whole message to
protobuf's own parser: such a message is rare (a newer client's field, a negative count
that the handler will refuse anyway), and the parser either builds the message or raises
the ``DecodeError`` that the transports answer INVALID_ARGUMENT as before. The ``starts``
map's entries (admissions' hashing contexts: sub-messages) are parsed by protobuf too, from
their own bytes. ``tests/server/test_step_codec.py`` compares both parsers on randomized
messages and encodings, and on malformed bytes.
"""

from __future__ import annotations

from typing import Any, Final

from google.protobuf.message import DecodeError

from kvsvc.v1 import kvcache_pb2 as pb

# Wire types.
_VARINT: Final = 0
_LEN: Final = 2
# StepRequest's field numbers (checked against the descriptor by the tests).
_POOL: Final = 1
_TYPES: Final = 2
_REQUEST_IDS: Final = 3
_NUM_TOKEN_IDS: Final = 4
_TOKEN_IDS: Final = 5
_NUM_NEW_TOKENS: Final = 6
_NUM_LOOKAHEAD_TOKENS: Final = 7
_STARTS: Final = 8
_NUM_REJECTED_TOKENS: Final = 9
_PACKED_TOKEN_IDS: Final = 10
_FREE_QUEUE_HEAD_LIMIT: Final = 11
_CALL_ID: Final = 12
_FREE_QUEUE_HEAD_OFFSET: Final = 13
_NUM_IN_FLIGHT_TOKENS: Final = 14
_INT32_END: Final = 1 << 31
_UINT32_END: Final = 1 << 32
# Messages up to this size are read as latin-1 text once, their ids sliced from it.
_TEXT_BYTES: Final = 1 << 20
# The last Step's request ids whose field bytes were contiguous (see _IdsRun), up to this
# many bytes of fields.
_IDS_RUN_BYTES: Final = 1 << 20


class _NotPlain(Exception):
    """The bytes use an encoding this reader leaves to protobuf (not an error)."""


class StepRequestView:
    """A Step request read from its bytes: the fields the handler, the journal and the
    replay read from a ``StepRequest``, under the same names, columns as lists.

    ``SerializeToString`` gives the bytes it was read from, which protobuf parses into
    the same message (what the journal keeps and replays).
    """

    __slots__ = (
        "_data",
        "call_id",
        "free_queue_head_limit",
        "free_queue_head_offset",
        "num_in_flight_tokens",
        "num_lookahead_tokens",
        "num_new_tokens",
        "num_rejected_tokens",
        "num_token_ids",
        "packed_token_ids",
        "pool",
        "request_ids",
        "starts",
        "token_ids",
        "types",
    )

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.pool = ""
        self.call_id = ""
        self.types: list[int] = []
        self.request_ids: list[str] = []
        self.num_token_ids: list[int] = []
        self.token_ids: list[int] = []
        self.num_new_tokens: list[int] = []
        self.num_lookahead_tokens: list[int] = []
        self.num_rejected_tokens: list[int] = []
        self.num_in_flight_tokens: list[int] = []
        self.starts: Any = {}
        self.packed_token_ids = b""
        self.free_queue_head_limit = 0
        self.free_queue_head_offset = 0

    def SerializeToString(self) -> bytes:
        """The bytes read (protobuf's name: the journal keeps a request this way)."""
        return self._data

    def to_pb(self) -> pb.StepRequest:
        """The protobuf message of the same bytes."""
        return pb.StepRequest.FromString(self._data)


class _IdsRun:
    """The request ids of the last Step read: their fields' bytes, as one run, and the ids.

    An engine's consecutive Steps mostly name the same running requests in the same order:
    the same bytes, field for field. When a Step's ids begin with the last one's bytes,
    those ids are the last ones' (equal bytes decode to equal text), taken as they are:
    no string is built again, and each keeps its computed hash for the core's lookups.
    The ids after the run (new requests) are read one by one as before. Only complete
    fields are kept, so a match always ends on a field's end.
    """

    __slots__ = ("fields", "ids")

    def __init__(self) -> None:
        self.fields = b""
        self.ids: list[str] = []


_last_ids = _IdsRun()


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (at most five bytes) and the position after it."""
    value = 0
    shift = 0
    while True:
        if pos >= end or shift > 28:
            raise _NotPlain
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _extend_varints(column: list[int], data: bytes, pos: int, end: int, limit: int) -> None:
    """Append the packed varints of ``data[pos:end]`` to ``column``, each below ``limit``."""
    payload = data[pos:end]
    if payload.isascii():  # one byte each: the values themselves (in C)
        column.extend(payload)
        return
    while pos < end:
        value, pos = _varint(data, pos, end)
        if value >= limit:
            raise _NotPlain
        column.append(value)


def _read(data: bytes) -> StepRequestView:
    global _last_ids
    view = StepRequestView(data)
    starts: list[bytes] = []
    text: str | None = None
    end = len(data)
    pos = 0
    # Where this message's id fields run, while they are contiguous (-1: not begun;
    # ids_end = -1 after: not contiguous).
    ids_begin = -1
    ids_end = 0
    reused = False  # the ids are the last run's, none after it (the run stays)
    last = _last_ids
    while pos < end:
        field_start = pos
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(data, pos, end)
        number = key >> 3
        wire = key & 7
        if wire == _LEN:
            size = data[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(data, pos, end)
            stop = pos + size
            if stop > end:
                raise _NotPlain
            if number == _REQUEST_IDS:
                if ids_begin < 0:
                    ids_begin = field_start
                    ids_end = field_start
                    known = last.fields
                    if known and data.startswith(known, field_start):
                        # The last Step's ids, field for field (see _IdsRun).
                        view.request_ids = list(last.ids)
                        pos = ids_end = field_start + len(known)
                        reused = True
                        continue
                reused = False
                if ids_end != field_start:
                    ids_end = -1  # another field between ids: not one run
                elif ids_end >= 0:
                    ids_end = stop
                if text is None:
                    text = data.decode("latin-1") if end <= _TEXT_BYTES else ""
                name = text[pos:stop] if text else ""
                # An ASCII id read from the message's latin-1 text is the id (one copy,
                # not a slice of bytes and its decoding: half the time); others decode.
                view.request_ids.append(
                    name if name.isascii() and len(name) == size else data[pos:stop].decode()
                )
            elif number == _TYPES:
                _extend_varints(view.types, data, pos, stop, _INT32_END)
            elif number == _NUM_TOKEN_IDS:
                _extend_varints(view.num_token_ids, data, pos, stop, _INT32_END)
            elif number == _NUM_NEW_TOKENS:
                _extend_varints(view.num_new_tokens, data, pos, stop, _INT32_END)
            elif number == _POOL:
                view.pool = data[pos:stop].decode()
            elif number == _PACKED_TOKEN_IDS:
                view.packed_token_ids = data[pos:stop]
            elif number == _CALL_ID:
                view.call_id = data[pos:stop].decode()
            elif number == _STARTS:
                starts.append(data[field_start:stop])
            elif number == _TOKEN_IDS:
                _extend_varints(view.token_ids, data, pos, stop, _UINT32_END)
            elif number == _NUM_LOOKAHEAD_TOKENS:
                _extend_varints(view.num_lookahead_tokens, data, pos, stop, _INT32_END)
            elif number == _NUM_REJECTED_TOKENS:
                _extend_varints(view.num_rejected_tokens, data, pos, stop, _INT32_END)
            elif number == _NUM_IN_FLIGHT_TOKENS:
                _extend_varints(view.num_in_flight_tokens, data, pos, stop, _INT32_END)
            else:
                raise _NotPlain
            pos = stop
        elif wire == _VARINT:
            value, pos = _varint(data, pos, end)
            if number == _TOKEN_IDS:
                if value >= _UINT32_END:
                    raise _NotPlain
                view.token_ids.append(value)
                continue
            if value >= _INT32_END:
                raise _NotPlain
            if number == _TYPES:
                view.types.append(value)
            elif number == _NUM_TOKEN_IDS:
                view.num_token_ids.append(value)
            elif number == _NUM_NEW_TOKENS:
                view.num_new_tokens.append(value)
            elif number == _NUM_LOOKAHEAD_TOKENS:
                view.num_lookahead_tokens.append(value)
            elif number == _NUM_REJECTED_TOKENS:
                view.num_rejected_tokens.append(value)
            elif number == _NUM_IN_FLIGHT_TOKENS:
                view.num_in_flight_tokens.append(value)
            elif number == _FREE_QUEUE_HEAD_LIMIT:
                view.free_queue_head_limit = value
            elif number == _FREE_QUEUE_HEAD_OFFSET:
                view.free_queue_head_offset = value
            else:
                raise _NotPlain
        else:
            raise _NotPlain
    if (
        not reused
        and ids_begin >= 0
        and ids_end > ids_begin
        and ids_end - ids_begin <= _IDS_RUN_BYTES
    ):
        run = _IdsRun()
        run.fields = data[ids_begin:ids_end]
        run.ids = list(view.request_ids)
        _last_ids = run
    if starts:
        # The map's entries alone: protobuf merges them as it would in the whole message.
        view.starts = pb.StepRequest.FromString(b"".join(starts)).starts
    return view


def parse_step_request(data: bytes) -> Any:
    """A Step request's bytes as the handler reads them: a :class:`StepRequestView`, or
    protobuf's ``StepRequest`` where the bytes use an encoding left to protobuf.

    Raises:
        google.protobuf.message.DecodeError: the bytes are not a StepRequest (protobuf's
            own error, as ``StepRequest.FromString`` raises it).
    """
    try:
        return _read(data)
    except (_NotPlain, UnicodeDecodeError, DecodeError):
        # DecodeError: the starts' own parse; the whole message's says what is wrong.
        return pb.StepRequest.FromString(data)
