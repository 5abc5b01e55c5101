"""The Step request's raw codec reads every message exactly as protobuf's parser does.

:func:`~kvsvc.server.step_codec.parse_step_request` walks the bytes itself and hands what
it does not read to protobuf. Here both parsers read the same bytes: randomized messages
(deterministic seeds) written in every encoding protobuf accepts (fields in any order, a
singular field repeated, repeated scalars packed, split or not packed, non-canonical
varints, unknown fields, negative and out-of-range values, the starts map's entries), and
malformed bytes (truncated, corrupted). Each must give the same fields, or the same
``DecodeError``; the plain encodings must take the raw path (or the test would compare
protobuf with itself).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from google.protobuf.message import DecodeError

from kvsvc.server import step_codec
from kvsvc.server.step_codec import StepRequestView, parse_step_request
from kvsvc.server.wire import StepColumns
from kvsvc.v1 import kvcache_pb2 as pb

_INT_COLUMNS = (
    "types",
    "num_token_ids",
    "num_new_tokens",
    "num_lookahead_tokens",
    "num_rejected_tokens",
    "num_in_flight_tokens",
)
# What StepColumns keeps of a request (its slots; a compiled class lists none).
_COLUMNS = (
    *_INT_COLUMNS,
    "free_queue_head_limit",
    "free_queue_head_offset",
    "packed_token_ids",
    "request_ids",
    "sent_request_ids",
)
_NUMBERS = {field.name: field.number for field in pb.StepRequest.DESCRIPTOR.fields}
_FIELDS = [field.name for field in pb.StepRequest.DESCRIPTOR.fields]


def _varint(value: int, padding: int = 0) -> bytes:
    """``value`` as a varint (a negative one as its 10-byte two's complement), with
    ``padding`` redundant continuation bytes (non-canonical, accepted by protobuf)."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    if padding:
        out.append(value | 0x80)
        out += b"\x80" * (padding - 1)
        out.append(0)
    else:
        out.append(value)
    return bytes(out)


def _key(number: int, wire: int, rng: random.Random) -> bytes:
    return _varint(number << 3 | wire, 1 if rng.random() < 0.05 else 0)


def _len_field(number: int, payload: bytes, rng: random.Random) -> bytes:
    return _key(number, 2, rng) + _varint(len(payload), 1 if rng.random() < 0.05 else 0) + payload


def _int_value(rng: random.Random, large: int) -> int:
    roll = rng.random()
    if roll < 0.6:
        return rng.randrange(0, 4)
    if roll < 0.8:
        return rng.choice([126, 127, 128, 129, 255, 16383, 16384, 2**21, 2**28 - 1, 2**28])
    if roll < 0.93:
        return rng.randrange(0, large)
    return rng.choice([-1, -(2**31), 2**31 - 1, -5])


def _string(rng: random.Random) -> str:
    alphabet = "abc-_0123456789" + ("é世\U0001f600" if rng.random() < 0.3 else "")
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))


def _start(rng: random.Random) -> pb.RequestStart:
    start = pb.RequestStart(num_prompt_tokens=rng.randrange(0, 100))
    if rng.random() < 0.5:
        start.hashing.cache_salt = _string(rng)
    if rng.random() < 0.3:
        start.max_cache_hit_tokens = rng.randrange(0, 50)
    return start


def _repeated_ints(number: int, values: list[int], rng: random.Random) -> list[bytes]:
    """A repeated varint field's encodings: packed whole, packed in pieces, not packed."""
    style = rng.random()
    if style < 0.5 or not values:
        pieces = [values]
    elif style < 0.75:
        cut = rng.randrange(0, len(values) + 1)
        pieces = [values[:cut], values[cut:]]
    else:
        return [
            # Padded within five bytes (longer varints: the negative values do that).
            _key(number, 0, rng) + _varint(v, 1 if 0 <= v < 2**28 and rng.random() < 0.05 else 0)
            for v in values
        ]
    return [_len_field(number, b"".join(_varint(v) for v in piece), rng) for piece in pieces]


def _message(rng: random.Random, *, plain: bool) -> bytes:
    """A random StepRequest's bytes; ``plain``: only encodings the raw path reads."""
    n = rng.randrange(0, 24)
    fields: list[bytes] = []
    large = 2**31 if plain else 2**32
    for name in _INT_COLUMNS:
        if rng.random() < 0.7:
            count = n if rng.random() < 0.8 else rng.randrange(0, n + 2)
            values = [_int_value(rng, large) for _ in range(count)]
            if plain:
                values = [v if 0 <= v < 2**31 else 7 for v in values]
            fields += _repeated_ints(_NUMBERS[name], values, rng)
    for _ in range(n if rng.random() < 0.9 else rng.randrange(0, n + 2)):
        fields.append(_len_field(_NUMBERS["request_ids"], _string(rng).encode(), rng))
    if rng.random() < 0.3:
        tokens = [rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 30))]
        fields += _repeated_ints(_NUMBERS["token_ids"], tokens, rng)
    for _ in range(rng.choice([0, 0, 1, 2])):
        fields.append(
            _len_field(_NUMBERS["packed_token_ids"], rng.randbytes(4 * rng.randrange(0, 9)), rng)
        )
    for name in ("pool", "call_id"):
        for _ in range(rng.choice([0, 1, 1, 2])):
            fields.append(_len_field(_NUMBERS[name], _string(rng).encode(), rng))
    for name in ("free_queue_head_limit", "free_queue_head_offset"):
        for _ in range(rng.choice([0, 1, 2])):
            value = _int_value(rng, 2**31)
            if plain and not 0 <= value < 2**31:
                value = 3
            fields.append(_key(_NUMBERS[name], 0, rng) + _varint(value))
    for _ in range(rng.choice([0, 0, 1, 3])):
        entry = pb.StepRequest(starts={rng.randrange(-2, n + 2): _start(rng)})
        fields.append(entry.SerializeToString())
    if not plain and rng.random() < 0.3:
        number = rng.randrange(15, 40)
        wire = rng.choice([0, 1, 2, 5])
        payload = {
            0: _varint(rng.randrange(0, 1000)),
            1: rng.randbytes(8),
            2: _varint(3) + b"xyz",
            5: rng.randbytes(4),
        }[wire]
        fields.append(_key(number, wire, rng) + payload)
    if not plain and rng.random() < 0.1:
        # A known field with another wire type: protobuf keeps it as an unknown field.
        fields.append(_key(_NUMBERS["types"], 5, rng) + rng.randbytes(4))
    rng.shuffle(fields)
    return b"".join(fields)


def _fields(message: Any) -> dict[str, Any]:
    """What a handler reads of a StepRequest or a view, as plain values."""
    out: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(message, name)
        if name == "starts":
            out[name] = {k: v.SerializeToString(deterministic=True) for k, v in value.items()}
        elif isinstance(value, (str, bytes, int)):
            out[name] = value
        else:
            out[name] = list(value)
    return out


def _same_as_protobuf(data: bytes) -> Any:
    """Parse ``data`` both ways and require the same outcome; the raw codec's result."""
    try:
        expected = pb.StepRequest.FromString(data)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as raised:
            parse_step_request(data)
        assert str(raised.value) == str(exc)
        return None
    parsed = parse_step_request(data)
    assert _fields(parsed) == _fields(expected)
    # What the journal keeps parses back to the same message.
    assert pb.StepRequest.FromString(parsed.SerializeToString()) == expected
    return parsed


def test_the_field_numbers_are_the_descriptors() -> None:
    assert {name: getattr(step_codec, f"_{name.upper()}") for name in _FIELDS} == _NUMBERS
    view = StepRequestView(b"")
    assert all(hasattr(view, name) for name in _FIELDS)


@pytest.mark.parametrize("seed", range(6))
def test_plain_encodings_take_the_raw_path_and_read_as_protobuf_does(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        data = _message(rng, plain=True)
        parsed = _same_as_protobuf(data)
        assert isinstance(parsed, StepRequestView), data.hex()


@pytest.mark.parametrize("seed", range(6))
def test_any_encoding_reads_as_protobuf_does(seed: int) -> None:
    rng = random.Random(1000 + seed)
    kinds = set()
    for _ in range(300):
        parsed = _same_as_protobuf(_message(rng, plain=False))
        kinds.add(type(parsed))
    # Both paths were taken (the unusual encodings are left to protobuf).
    assert {StepRequestView, pb.StepRequest} <= kinds


@pytest.mark.parametrize("seed", range(4))
def test_malformed_bytes_fail_as_protobuf_fails(seed: int) -> None:
    rng = random.Random(2000 + seed)
    failures = 0
    for _ in range(300):
        data = bytearray(_message(rng, plain=rng.random() < 0.5))
        if not data:
            continue
        roll = rng.random()
        if roll < 0.4:
            del data[rng.randrange(0, len(data)) :]  # truncated
        elif roll < 0.8:
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(0, len(data))] = rng.randrange(0, 256)
        else:
            data += rng.choice([b"\x80", b"\x1a\x05ab", b"\x00", b"\x07", b"\x2a\xff"])
        failures += _same_as_protobuf(bytes(data)) is None
    assert failures  # some of them do not parse at all


@pytest.mark.parametrize(
    "data",
    [
        b"\x1a\x02\xc3\x28",  # a request id that is not UTF-8
        b"\x0a\x01\xff",  # a pool name that is not UTF-8
        b"\x12\x01",  # a packed column cut short
        b"\x12\x02\x80\x80",  # a varint cut short inside a packed column
        b"\x42\x03\x08\x01\x12",  # a starts entry cut short
        b"\x00\x01",  # field number 0
        b"\x58\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # an 11-byte varint
    ],
)
def test_known_malformed_messages_are_refused_with_protobufs_error(data: bytes) -> None:
    assert _same_as_protobuf(data) is None


def test_the_handler_reads_the_same_columns_either_way() -> None:
    rng = random.Random(7)
    for _ in range(200):
        data = _message(rng, plain=True)
        outcomes = []
        for request in (pb.StepRequest.FromString(data), parse_step_request(data)):
            try:
                columns = StepColumns(request, 64)
            except Exception as exc:  # the same refusal, in the same words
                outcomes.append((type(exc), str(exc)))
            else:
                outcomes.append(
                    {name: getattr(columns, name) for name in _COLUMNS}
                    | {"starts": sorted(columns.starts), "token_ids": list(columns.token_ids)}
                )
        assert outcomes[0] == outcomes[1]


def _ids_step(ids: list[str], *, between: bytes = b"", tail: bytes = b"") -> bytes:
    """A Step whose id fields run in a row (``between`` goes after the first id)."""
    fields = [b"\x0a\x05bench", b"\x12\x01\x01"]
    for index, name in enumerate(ids):
        encoded = name.encode()
        fields.append(b"\x1a" + _varint(len(encoded)) + encoded)
        if index == 0 and between:
            fields.append(between)
    return b"".join(fields) + tail


def test_a_step_naming_the_last_ones_ids_reads_them_as_protobuf_does() -> None:
    """Consecutive Steps share their ids' bytes (see step_codec._IdsRun): the same, more,
    fewer, one changed, a field between them, a non-ASCII id, one left to protobuf; each
    read as protobuf reads it."""
    base = [f"req-{i}" for i in range(40)]
    first = _same_as_protobuf(_ids_step(base))
    # The same ids: the last Step's strings themselves (not built again).
    again = _same_as_protobuf(_ids_step(base, tail=b"\x22\x01\x01"))
    assert all(a is b for a, b in zip(again.request_ids, first.request_ids, strict=True))
    # The caller's list is its own: changing it changes no later read.
    again.request_ids[0] = "changed"
    assert _same_as_protobuf(_ids_step(base)).request_ids[0] == "req-0"
    variants = [
        [*base, "new-1", "new-2"],  # the run, then new requests
        base[:-1],  # one fewer: not the run's bytes
        [*base[:10], "other", *base[11:]],  # one changed in the middle
        ["requête-é", *base],  # a non-ASCII id first
        [*base, "requête-é"],
        base,
        [],
        base,
    ]
    for ids in variants:
        parsed = _same_as_protobuf(_ids_step(ids))
        assert isinstance(parsed, StepRequestView)
    # Another field between the ids: still protobuf's reading, before and after.
    for _ in range(2):
        _same_as_protobuf(_ids_step(base, between=b"\x20\x01"))
    _same_as_protobuf(_ids_step(base))
    # A message left to protobuf (an unknown field) between two that take the run.
    assert isinstance(_same_as_protobuf(_ids_step(base, tail=b"\xf8\x01\x01")), pb.StepRequest)
    assert _same_as_protobuf(_ids_step([*base[:5], "x"])).request_ids[:6] == [*base[:5], "x"]
