"""Packed repeated-varint columns written as bytes, for the client's Steps and the
server's Step replies alike.

protobuf converts a Python list into a repeated field element by element (~15 ns each);
a column of small counts written here as the field's bytes (its key, its length, one byte
a value) is parsed by protobuf in C. The keys come from the messages' descriptors, so the
two ends that write these columns (:mod:`kvsvc_client._wire`'s ``StepBuilder``,
:mod:`kvsvc.server.wire`'s Step reply) cannot go out of step with the ``.proto``.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_VARINT_TYPES = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_ENUM,
}


def packed_varint_tags(message: Any) -> dict[str, bytes]:
    """The key bytes (field number, wire type 2) of each packed varint column of
    ``message``, from its descriptor (so a renumbered field cannot go out of step)."""
    return {
        field.name: _varint(field.number << 3 | 2)
        for field in message.DESCRIPTOR.fields
        if field.is_repeated and field.type in _VARINT_TYPES and field.is_packed
    }


def packed_one_byte_field(tag: bytes, values: list[int]) -> bytes | None:
    """``values`` as a packed varint field when each is in [0, 128) (one byte on the wire,
    the value itself); b"" for none; None otherwise (``bytes()`` refuses values outside
    [0, 256) and ``isascii()`` finds any of two bytes, both in C).

    The server's replies and the client's Steps use it for columns of small counts:
    protobuf converts a list element by element (~15 ns each), parsing bytes is in C.
    """
    try:
        payload = bytes(values)
    except (ValueError, TypeError):
        return None
    if not payload:
        return b""
    if not payload.isascii():
        return None
    return tag + _varint(len(payload)) + payload
