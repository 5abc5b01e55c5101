"""Protobuf <-> core conversion for the engine-facing calls (the hot path).

Kept apart from the servicers so the translation can be read (and optimised) in one
place: ``Step`` decodes its columns into plain lists once and builds its response
columns as lists, letting protobuf copy them in bulk.
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Sequence
from typing import Any, cast

from librt.strings import BytesWriter

from kvsvc.core import (
    MAX_MM_ITEMS,
    AllBlocksCleared,
    AllocateOutcome,
    BlockRemoved,
    BlockStored,
    HashingContext,
    KVEvent,
    KVEventBatch,
    MultiModalItem,
    RequestStart,
    check_hashing_strings,
)
from kvsvc.core.hashing import unpack_token_ids
from kvsvc.errors import InvalidArgument
from kvsvc.v1 import kvcache_pb2 as pb
from kvsvc.wire.packed import packed_one_byte_field, packed_varint_tags

MAX_REQUEST_ID_BYTES = 256
STATUS_OK: int = pb.ALLOCATE_STATUS_OK
STATUS_NO_SPACE: int = pb.ALLOCATE_STATUS_NO_SPACE
STATUS_RECOMPUTE: int = pb.ALLOCATE_STATUS_RECOMPUTE
STATUS_REJECTED: int = pb.ALLOCATE_STATUS_UNSPECIFIED


def check_request_id(request_id: str, field: str = "request_id") -> None:
    """The bound is on UTF-8 bytes: ids index the server's tables and logs by their bytes."""
    if not request_id:
        raise InvalidArgument(field, "must not be empty")
    if "\x00" in request_id:  # the engine-namespace separator (kvsvc.server.namespace)
        raise InvalidArgument(field, "must not contain a NUL character")
    # Every character is at most 4 bytes: short ids need no encoding to be known in bounds.
    if len(request_id) > MAX_REQUEST_ID_BYTES // 4 and (
        len(request_id.encode()) > MAX_REQUEST_ID_BYTES
    ):
        raise InvalidArgument(field, f"longer than {MAX_REQUEST_ID_BYTES} bytes (UTF-8)")


def token_ids_of(repeated: Any, packed: bytes, field: str, packed_field: str) -> Sequence[int]:
    """Token ids from whichever of the two encodings a request used (not both).

    A list for the repeated field; an ``array('I')`` for the packed one (the core keeps it
    as the request's token sequence without materialising a Python int per token). An
    error names ``field``, the ids as the API calls them: the packed form is the clients'
    encoding (kvsvc's Python client always packs), named only where only it can be wrong.
    """
    if packed:
        if len(repeated):
            raise InvalidArgument(
                field, f"sent both as a list and packed ({packed_field}): send one of the two"
            )
        return unpack_token_ids(packed, f"{field} ({packed_field})")
    return list(repeated)


def hashing_from_pb(msg: pb.HashingContext, where: str) -> HashingContext | None:
    """The core's hashing context; None when the message carries nothing.

    Items are checked for shape here (and their number bounded before any is converted),
    the strings' byte bounds too (so an oversized one is refused before anything else
    reads it, on every path that takes a context: Allocate, Step, Lookup, the router's
    Score); that each item lies inside the prompt, and the identifier bound, the core
    checks (``kvsvc.core.check_hashing_context``) where the prompt's length is known.
    """
    if len(msg.mm_items) > MAX_MM_ITEMS:
        raise InvalidArgument(
            f"{where}.mm_items", f"{len(msg.mm_items)} items exceed the limit of {MAX_MM_ITEMS}"
        )
    items: list[MultiModalItem] = []
    last_offset = -1
    for i, item in enumerate(msg.mm_items):
        field = f"{where}.mm_items[{i}]"
        if not item.identifier:
            raise InvalidArgument(f"{field}.identifier", "must not be empty")
        if item.offset < 0 or item.length <= 0:
            raise InvalidArgument(field, "offset must be >= 0 and length > 0")
        if item.offset < last_offset:
            raise InvalidArgument(field, "items must be sorted by offset")
        last_offset = item.offset
        items.append(MultiModalItem(item.identifier, item.offset, item.length))
    if not (msg.cache_salt or msg.lora_name or msg.lora_path or items or msg.prompt_embeds_digests):
        return None
    if msg.lora_path and not msg.lora_name:
        raise InvalidArgument(f"{where}.lora_name", "required when lora_path is set")
    if msg.lora_id and not msg.lora_name:
        raise InvalidArgument(f"{where}.lora_name", "required when lora_id is set")
    context = HashingContext(
        cache_salt=msg.cache_salt or None,
        lora_name=msg.lora_name or None,
        lora_path=msg.lora_path or None,
        mm_items=tuple(items),
        prompt_embeds_digests=tuple(msg.prompt_embeds_digests),
        lora_id=msg.lora_id or None,
    )
    check_hashing_strings(context, where)
    return context


# The start of an admission that sets nothing (no hashing context, no flags, no counts):
# RequestStart is frozen, so one instance serves every such admission.
_PLAIN_START = RequestStart()


def start_from_pb(msg: pb.RequestStart, where: str) -> RequestStart:
    if not msg.ByteSize():
        # Every field at its default: what the fields below would read, without reading
        # each through protobuf (~14 attribute reads, ~10k instructions an admission).
        return _PLAIN_START
    if msg.num_encoder_tokens < 0:
        raise InvalidArgument(f"{where}.num_encoder_tokens", "must be >= 0")
    if msg.num_prompt_tokens < 0:
        raise InvalidArgument(f"{where}.num_prompt_tokens", "must be >= 0")
    if msg.num_draft_tokens < 0:
        raise InvalidArgument(f"{where}.num_draft_tokens", "must be >= 0")
    max_hit = msg.max_cache_hit_tokens if msg.HasField("max_cache_hit_tokens") else None
    if max_hit is not None and max_hit < 0:
        raise InvalidArgument(f"{where}.max_cache_hit_tokens", "must be >= 0")
    return RequestStart(
        hashing=hashing_from_pb(msg.hashing, f"{where}.hashing"),
        skip_prefix_cache_read=msg.skip_prefix_cache_read,
        resumed=msg.resumed,
        num_encoder_tokens=msg.num_encoder_tokens,
        num_prompt_tokens=msg.num_prompt_tokens,
        max_cache_hit_tokens=max_hit,
        num_draft_tokens=msg.num_draft_tokens,
    )


def outcome_status(outcome: AllocateOutcome) -> int:
    """The wire status of an allocation's outcome."""
    if outcome.ok:
        return STATUS_OK
    return STATUS_RECOMPUTE if outcome.recompute else STATUS_NO_SPACE


def _key(message: Any, name: str) -> int:
    """The one-byte key of ``message``'s field ``name`` (varint: wire type 0; a message or
    packed column: 2), from the descriptor, so a renumbered field cannot go out of step."""
    field = message.DESCRIPTOR.fields_by_name[name]
    wire_type = 2 if field.type == field.TYPE_MESSAGE or field.is_repeated else 0
    key = field.number << 3 | wire_type
    assert key < 0x80, f"{name}: a key past one byte"
    return key


_ALLOCATE_STATUS = _key(pb.AllocateResponse, "status")
_ALLOCATE_NEW_BLOCKS = _key(pb.AllocateResponse, "new_blocks")
_ALLOCATE_COUNTS = (
    _key(pb.AllocateResponse, "num_cached_tokens"),
    _key(pb.AllocateResponse, "num_scheduled_tokens"),
    _key(pb.AllocateResponse, "num_computed_tokens"),
)
_GROUP_BLOCK_IDS = packed_varint_tags(pb.GroupBlocks)["block_ids"]
_GROUP_NUM_NULL_BLOCKS = _key(pb.GroupBlocks, "num_null_blocks")


def _write_varint(out: BytesWriter, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _write_field(out: BytesWriter, key: int, payload: BytesWriter) -> None:
    """A length-delimited field: its key, its length, its bytes."""
    out.append(key)
    _write_varint(out, len(payload))
    out.write(payload.getvalue())


def allocate_reply_bytes(outcome: AllocateOutcome) -> bytes | None:
    """The bytes of ``allocate_response(outcome)``, written here: protobuf's serialization
    of the message (fields in number order, each at its default omitted, a group's block
    ids one packed column), without building the message and its groups first (~70k
    instructions of a 2048-token admission's ~740k, ``instruction_counts.py``). None for a
    value an int32 field cannot hold as a plain varint (a negative one: protobuf's)."""
    out = BytesWriter()
    status = outcome_status(outcome)
    if status:
        out.append(_ALLOCATE_STATUS)
        _write_varint(out, status)
    for ids, num_null in zip(outcome.new_block_ids, outcome.num_null_blocks, strict=True):
        group = BytesWriter()
        if ids:
            column = _varint_column(_GROUP_BLOCK_IDS, ids)
            if column is None:
                return None
            group.write(column)
        if num_null:
            if num_null < 0 or num_null > _INT32_MAX:
                return None
            group.append(_GROUP_NUM_NULL_BLOCKS)
            _write_varint(group, num_null)
        _write_field(out, _ALLOCATE_NEW_BLOCKS, group)
    scheduled = outcome.num_scheduled_tokens if outcome.ok else 0
    counts = (outcome.num_cached_tokens, scheduled, outcome.num_computed_tokens)
    for key, value in zip(_ALLOCATE_COUNTS, counts, strict=True):
        if value:
            if value < 0 or value > _INT32_MAX:
                return None
            out.append(key)
            _write_varint(out, value)
    return out.getvalue()


def allocate_response(outcome: AllocateOutcome) -> pb.AllocateResponse:
    return pb.AllocateResponse(
        status=cast(pb.AllocateStatus, outcome_status(outcome)),
        new_blocks=[
            pb.GroupBlocks(block_ids=ids, num_null_blocks=nulls)
            for ids, nulls in zip(outcome.new_block_ids, outcome.num_null_blocks, strict=True)
        ],
        num_cached_tokens=outcome.num_cached_tokens,
        num_scheduled_tokens=outcome.num_scheduled_tokens if outcome.ok else 0,
        num_computed_tokens=outcome.num_computed_tokens,
    )


# A Step's per-operation columns besides types, and what the API calls their values.
_PER_OPERATION = (
    ("request_ids", "request ids"),
    ("num_token_ids", "token counts"),
    ("num_new_tokens", "num_new_tokens values"),
    ("num_lookahead_tokens", "num_lookahead_tokens values"),
    ("num_rejected_tokens", "num_rejected_tokens values"),
    ("num_in_flight_tokens", "num_in_flight_tokens values"),
)

# The most free-queue ids one Step reply carries (StepRequest.free_queue_head_limit).
MAX_FREE_QUEUE_HEAD = 65536


class StepColumns:
    """A Step request decoded into plain lists, validated for shape."""

    __slots__ = (
        "free_queue_head_limit",
        "free_queue_head_offset",
        "num_in_flight_tokens",
        "num_lookahead_tokens",
        "num_new_tokens",
        "num_rejected_tokens",
        "num_token_ids",
        "packed_token_ids",
        "request_ids",
        "sent_request_ids",
        "starts",
        "token_ids",
        "types",
    )

    def __init__(self, request: Any, max_operations: int) -> None:
        # Errors speak of operations, request ids and token counts, as the API does (the
        # Python client's StepBuilder, the engine's view): a column's name appears only in
        # brackets, for a client that writes the columns itself.
        self.types: list[int] = list(request.types)
        n = len(self.types)
        if n > max_operations:
            raise InvalidArgument(
                "Step",
                f"{n} operations exceed the limit of {max_operations} per call "
                "(the server's max_step_operations)",
            )
        self.request_ids: list[str] = list(request.request_ids)
        # The ids as sent; request_ids becomes the engine-namespaced form when scoped.
        self.sent_request_ids: list[str] = self.request_ids
        self.token_ids: Sequence[int] = token_ids_of(
            request.token_ids, request.packed_token_ids, "Step token ids", "packed_token_ids"
        )
        # Kept so admissions can hand the core their already-checked packed prompt.
        self.packed_token_ids: bytes | None = request.packed_token_ids or None
        self.num_token_ids: list[int] = list(request.num_token_ids) or [0] * n
        self.num_new_tokens: list[int] = list(request.num_new_tokens) or [0] * n
        self.num_lookahead_tokens: list[int] = list(request.num_lookahead_tokens) or [0] * n
        self.num_rejected_tokens: list[int] = list(request.num_rejected_tokens) or [0] * n
        self.num_in_flight_tokens: list[int] = list(request.num_in_flight_tokens) or [0] * n
        for name, what in _PER_OPERATION:
            given = len(getattr(self, name))
            if given != n:
                raise InvalidArgument(
                    "Step",
                    f"{given} {what} ({name}) for {n} operations: one per operation"
                    + ("" if name == "request_ids" else ", or none for all 0"),
                )
        # One native loop, not the builtins sum() and min() (each the generic number
        # protocol per item: ~2% of a 256-decode Step's instructions together).
        total_tokens = 0
        any_negative = False
        for count in self.num_token_ids:
            total_tokens += count
            if count < 0:
                any_negative = True
        if total_tokens != len(self.token_ids) or any_negative:
            raise InvalidArgument(
                "Step",
                "the operations' token counts (num_token_ids) must be >= 0 and add up to the "
                f"{len(self.token_ids)} token ids sent",
            )
        self.starts: dict[int, Any] = dict(request.starts) if request.starts else {}
        for index in self.starts:
            if not 0 <= index < n:
                raise InvalidArgument(
                    "Step",
                    f"a start (starts) for operation {index}, which is not one of its "
                    f"{n} operations",
                )
        self.free_queue_head_limit: int = request.free_queue_head_limit
        if not 0 <= self.free_queue_head_limit <= MAX_FREE_QUEUE_HEAD:
            raise InvalidArgument(
                "free_queue_head_limit",
                f"must be in [0, {MAX_FREE_QUEUE_HEAD}], got {self.free_queue_head_limit}",
            )
        self.free_queue_head_offset: int = request.free_queue_head_offset
        if self.free_queue_head_offset < 0:
            raise InvalidArgument(
                "free_queue_head_offset", f"must be >= 0, got {self.free_queue_head_offset}"
            )
        if self.free_queue_head_offset and n:
            # A page past the front is read where the last one ended (O(page)); the
            # operations would move the queue first, and the page could not be bounded
            # before they changed the pool.
            raise InvalidArgument(
                "free_queue_head_offset",
                f"pages the free queue only in a Step without operations (this one has {n})",
            )


class StepResults:
    """Response columns accumulated operation by operation."""

    __slots__ = (
        "_zero_groups",
        "cached",
        "computed",
        "errors",
        "free_queue_head",
        "freed",
        "new_block_ids",
        "num_free_blocks",
        "num_groups",
        "num_new_blocks",
        "num_null_blocks",
        "released",
        "scheduled",
        "statuses",
    )

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        # A refused allocation released out-of-window blocks: the pool changed.
        self.released = False
        self._zero_groups = [0] * num_groups
        self.statuses: list[int] = []
        self.scheduled: list[int] = []
        self.computed: list[int] = []
        self.cached: list[int] = []
        self.num_new_blocks: list[int] = []
        self.new_block_ids: list[int] = []
        self.num_null_blocks: list[int] = []
        self.freed: list[int] = []
        self.errors: dict[int, pb.StepError] = {}
        self.free_queue_head: list[int] = []
        self.num_free_blocks = 0

    def add_free(self, num_freed: int) -> None:
        self.statuses.append(STATUS_OK)
        self.scheduled.append(0)
        self.computed.append(0)
        self.cached.append(0)
        self.num_new_blocks.extend(self._zero_groups)
        self.num_null_blocks.extend(self._zero_groups)
        self.freed.append(num_freed)

    def add_error(self, index: int, code: int, message: str) -> None:
        self.statuses.append(STATUS_REJECTED)
        self.scheduled.append(0)
        self.computed.append(0)
        self.cached.append(0)
        self.num_new_blocks.extend(self._zero_groups)
        self.num_null_blocks.extend(self._zero_groups)
        self.freed.append(0)
        self.errors[index] = pb.StepError(code=code, message=message)

    def to_pb(self) -> pb.StepResponse:
        """The reply message, the same one ``StepResponse(**columns)`` builds.

        Most columns of a decode step hold small counts (statuses, scheduled tokens, new
        blocks: 0 or 1). protobuf converts a list element by element (~15 ns each, ~40 us
        for a 256-operation reply); a column whose values all lie in [0, 128) is one byte
        per value on the wire, so it is written as those bytes and parsed (in C) instead.
        The other columns are set as lists; the message is equal either way (the property
        tests compare it with the constructor's).
        """
        large: dict[str, Any] = {}
        encoded: list[bytes] = []
        for name, values in (
            ("statuses", self.statuses),
            ("num_scheduled_tokens", self.scheduled),
            ("num_computed_tokens", self.computed),
            ("num_cached_tokens", self.cached),
            ("num_new_blocks", self.num_new_blocks),
            ("new_block_ids", self.new_block_ids),
            ("num_null_blocks", self.num_null_blocks),
            ("num_freed_blocks", self.freed),
            ("free_queue_head", self.free_queue_head),
        ):
            if values:
                field = packed_one_byte_field(_STEP_RESPONSE_TAGS[name], values)
                if field is None:
                    large[name] = values
                else:
                    encoded.append(field)
        response = pb.StepResponse(
            num_groups=self.num_groups,
            errors=self.errors,
            num_free_blocks=self.num_free_blocks,
            **large,
        )
        if encoded:
            response.MergeFromString(b"".join(encoded))
        return response

    def to_bytes(self) -> bytes | None:
        """The reply's wire bytes, exactly those ``to_pb().SerializeToString()`` gives,
        without the message; None where it has errors (``to_pb`` then: the map's order is
        protobuf's) or a value past int32 (``to_pb`` refuses it as protobuf does).

        protobuf writes the fields in field-number order, each packed column as one field
        (omitted when empty), a scalar only when not 0, and nothing else: so the message's
        bytes are its fields' bytes one after the other. A column of values in [0, 128)
        (most of a decode step's: statuses, counts of 0 or 1) is its key, its length and
        its values as bytes (made in C); a short column of values in [0, 2**31) and a
        scalar are their varints, written here (a message of one column built only to
        serialize it cost more than the rest of a small reply); anything else (a long
        column, which protobuf converts faster than this loop; a negative value, ten bytes
        in protobuf's encoding) is protobuf's serialization of a message holding that
        column alone. The property tests compare the bytes.
        """
        if self.errors:
            return None
        out: list[bytes] = []
        try:
            columns: tuple[tuple[str, Any], ...] = (
                ("statuses", self.statuses),
                ("num_scheduled_tokens", self.scheduled),
                ("num_computed_tokens", self.computed),
                ("num_cached_tokens", self.cached),
                ("num_groups", self.num_groups),
                ("num_new_blocks", self.num_new_blocks),
                ("new_block_ids", self.new_block_ids),
                ("num_null_blocks", self.num_null_blocks),
                ("num_freed_blocks", self.freed),
                ("free_queue_head", self.free_queue_head),
                ("num_free_blocks", self.num_free_blocks),
            )
            for name, values in columns:
                if not values:
                    continue
                if isinstance(values, list):
                    tag = _STEP_RESPONSE_TAGS[name]
                    field = _one_byte_column(tag, values)
                    if field is None and len(values) <= _VARINTS_WRITTEN_HERE:
                        field = _varint_column(tag, values)
                else:
                    field = _scalar_field(_STEP_RESPONSE_SCALAR_TAGS[name], values)
                if field is None:
                    alone: dict[str, Any] = {name: values}
                    field = pb.StepResponse(**alone).SerializeToString()
                out.append(field)
        except ValueError:  # a value the field cannot hold: to_pb refuses it alike
            return None
        return b"".join(out)


_STEP_RESPONSE_TAGS = packed_varint_tags(pb.StepResponse)
_INT32_MAX = 2**31 - 1
# Up to this many values a column's varints are written here; past it protobuf's own
# conversion (a message built for the column, ~3 us, then ~15 ns a value in C) is faster
# than this loop (~55 ns a value compiled). Measured: 1 value 6.3 -> 3.8 us a reply, 256
# values 22 us by protobuf against 29 us here.
_VARINTS_WRITTEN_HERE = 48
_UINT64_MAX = 2**64 - 1
# The keys of the reply's varint scalars (field number, wire type 0), and the largest
# value each holds (int32, uint64): from the descriptor, as the columns' keys are.
_STEP_RESPONSE_SCALAR_TAGS: dict[str, tuple[bytes, int]] = {
    field.name: (
        bytes((field.number << 3,)),
        _UINT64_MAX if field.type == field.TYPE_UINT64 else _INT32_MAX,
    )
    for field in pb.StepResponse.DESCRIPTOR.fields
    if not field.is_repeated
    and field.type in (field.TYPE_INT32, field.TYPE_UINT64)
    and field.number < 16  # a one-byte key
}


def _one_byte_column(tag: bytes, values: list[int]) -> bytes | None:
    """``packed_one_byte_field`` compiled here with the reply (it runs for most of a Step
    reply's columns): ``values`` as a packed field when each is in [0, 128), else None.

    The values are checked by a native loop, which also sees whether they are all one
    value (most of a decode Step's columns: statuses, scheduled, cached, freed): such a
    column is that byte repeated. ``bytes(values)`` converts each item through the number
    protocol (~65 instructions an item, ~130k a 256-decode Step's reply before this); a
    column of several values (a decode Step's new-block counts, 0 or 1) is written by a
    second native loop instead (~170 instructions an item through ``bytes(list)``)."""
    first = values[0] if values else 0
    uniform = True
    for value in values:
        if value < 0 or value >= 0x80:
            return None
        if value != first:
            uniform = False
    size = len(values)
    if uniform:
        payload = bytes((first,)) * size
    else:
        written = BytesWriter()
        for value in values:
            written.append(value)
        payload = written.getvalue()
    if size < 0x80:
        return tag + bytes((size,)) + payload
    return tag + _varint_bytes(size) + payload


def _varint_column(tag: bytes, values: list[int]) -> bytes | None:
    """``values`` as a packed int32 field, a varint each, when each is in [0, 2**31); else
    None (a negative value is ten bytes in protobuf's encoding, one past int32 is refused:
    both are left to protobuf)."""
    payload = BytesWriter()
    for value in values:
        if value < 0 or value > _INT32_MAX:
            return None
        _write_varint(payload, value)
    return tag + _varint_bytes(len(payload)) + payload.getvalue()


def _scalar_field(key: tuple[bytes, int], value: int) -> bytes | None:
    """A varint scalar (``key``: its key bytes and its type's largest value) when the
    value is in [0, largest]; else None (left to protobuf)."""
    tag, largest = key
    if value < 0 or value > largest:
        return None
    return tag + _varint_bytes(value)


def _varint_bytes(value: int) -> bytes:
    out = BytesWriter()
    _write_varint(out, value)
    return out.getvalue()


# How a packed event says what it is (its row's first item; see pack_events).
_PACKED_STORED = 1
_PACKED_REMOVED = 2
_PACKED_CLEARED = 3


def pack_events(events: list[KVEvent]) -> tuple[bytes | None, list[int]]:
    """A batch's events as one bytes object of plain values (``marshal``'s encoding of
    a tuple per event), and what the replay log counts of them: ``[stored, removed,
    cleared, hashes (each stored event's parent too), token ids, a hash's length]``.

    The bytes are None when a value does not pack (an extra key of a type ``marshal``
    does not write): the log then holds the batch as objects. Compiled with the core: the
    replay log packs every batch a change makes (:mod:`kvsvc.server.events`).
    """
    stored = removed = cleared = hashes = tokens = 0
    hash_len = 16
    rows: list[tuple[object, ...]] = []
    for event in events:
        if isinstance(event, BlockStored):
            stored += 1
            block_hashes = event.block_hashes
            hashes += len(block_hashes) + 1  # + the parent
            if block_hashes:
                hash_len = len(block_hashes[0])
            token_ids = event.token_ids
            tokens += len(token_ids)
            if not (isinstance(token_ids, array) and token_ids.typecode == "I"):
                token_ids = array("I", token_ids)
            rows.append(
                (
                    _PACKED_STORED,
                    tuple(block_hashes),
                    event.parent_block_hash,
                    token_ids.tobytes(),
                    event.block_size,
                    event.lora_name,
                    event.medium,
                    event.group_index,
                    event.group_kind,
                    event.extra_keys,
                    event.lora_id,
                )
            )
        elif isinstance(event, BlockRemoved):
            removed += 1
            block_hashes = event.block_hashes
            hashes += len(block_hashes)
            if block_hashes:
                hash_len = len(block_hashes[0])
            rows.append((_PACKED_REMOVED, tuple(block_hashes), event.medium, event.group_index))
        else:
            cleared += 1
            rows.append((_PACKED_CLEARED,))
    counts = [stored, removed, cleared, hashes, tokens, hash_len]
    try:
        return marshal.dumps(rows), counts
    except ValueError:
        return None, counts


def unpack_events(packed: bytes) -> list[KVEvent]:
    """The events of :func:`pack_events`' bytes, equal to those packed."""
    events: list[KVEvent] = []
    for row in marshal.loads(packed):
        kind = row[0]
        if kind == _PACKED_STORED:
            token_ids = array("I")
            token_ids.frombytes(row[3])
            events.append(
                BlockStored(
                    list(row[1]),
                    row[2],
                    token_ids,
                    row[4],
                    row[5],
                    row[6],
                    row[7],
                    row[8],
                    row[9],
                    row[10],
                )
            )
        elif kind == _PACKED_REMOVED:
            events.append(
                BlockRemoved(block_hashes=list(row[1]), medium=row[2], group_index=row[3])
            )
        else:
            events.append(AllBlocksCleared())
    return events


def _stored_to_pb(event: BlockStored) -> pb.KVEvent:
    stored = pb.BlockStored(
        block_hashes=event.block_hashes,
        token_ids=event.token_ids,
        block_size=event.block_size,
        lora_name=event.lora_name or "",
        medium=event.medium,
        group_index=event.group_index,
        group_kind=event.group_kind,
        lora_id=event.lora_id or 0,
    )
    if event.parent_block_hash is not None:
        stored.parent_block_hash = event.parent_block_hash
    return pb.KVEvent(stored=stored)


def event_batch_to_pb(batch: KVEventBatch) -> pb.WatchEventsResponse:
    events: list[pb.KVEvent] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(_stored_to_pb(event))
        elif isinstance(event, BlockRemoved):
            events.append(
                pb.KVEvent(
                    removed=pb.BlockRemoved(
                        block_hashes=event.block_hashes,
                        medium=event.medium,
                        group_index=event.group_index,
                    )
                )
            )
        elif isinstance(event, AllBlocksCleared):
            events.append(pb.KVEvent(cleared=pb.AllBlocksCleared()))
        else:  # pragma: no cover - the core defines exactly these
            raise TypeError(f"unknown event {event!r}")
    return pb.WatchEventsResponse(sequence=batch.seq, timestamp=batch.timestamp, events=events)
