"""Integer types on the wire: what a peer built against an older .proto still reads.

Token ids moved from ``repeated int64`` to ``repeated uint32`` (JavaScript gets numbers
instead of Longs, Go ``[]uint32``), and a pool's block figures from int64 (or int32) to
uint64 like the counters next to them: for the values they carry (never negative) the old
and new types are the same varints, so an engine built against the old files and a server
built against the new ones (or the other way round) exchange the same bytes. These tests
build the old field from a descriptor and check the bytes both ways, so a change to a
non-varint type (fixed32, sint32) or another field number fails here as well as in
``buf breaking``.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from kvsvc_client import InvalidArgumentError
from kvsvc_client._wire import StepBuilder, allocate_request, lookup_request

from kvsvc.v1 import admin_pb2, kvcache_pb2, specs_pb2, worker_pb2

TOKEN_FIELDS = [
    (kvcache_pb2.AllocateRequest, "new_token_ids"),
    (kvcache_pb2.StepRequest, "token_ids"),
    (kvcache_pb2.LookupRequest, "token_ids"),
    (kvcache_pb2.BlockStored, "token_ids"),
]
# Vocabulary-sized ids and the extremes of the server's range.
IDS = [0, 1, 127, 128, 151_935, 2**31 - 1]


_T = descriptor_pb2.FieldDescriptorProto
POOL_FIGURES = [
    (kvcache_pb2.GetUsageResponse, "num_blocks", _T.TYPE_INT64),
    (kvcache_pb2.GetUsageResponse, "num_free_blocks", _T.TYPE_INT64),
    (kvcache_pb2.GetUsageResponse, "num_cached_blocks", _T.TYPE_INT64),
    (kvcache_pb2.GetUsageResponse, "kv_cache_capacity_tokens", _T.TYPE_INT64),
    (kvcache_pb2.StepResponse, "num_free_blocks", _T.TYPE_INT32),
    (admin_pb2.PoolSummary, "num_blocks", _T.TYPE_INT64),
]


def _old_message(number: int, field_type: int, repeated: bool = True) -> type:
    """A message with one field ``number`` of ``field_type`` named ``ids`` (repeated ones
    are packed, as in proto3)."""
    file = descriptor_pb2.FileDescriptorProto(name="old.proto", package="old", syntax="proto3")
    message = file.message_type.add(name="Old")
    message.field.add(
        name="ids",
        number=number,
        type=field_type,  # type: ignore[arg-type]
        label=_T.LABEL_REPEATED if repeated else _T.LABEL_OPTIONAL,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("old.Old"))


@pytest.mark.parametrize(("cls", "name"), TOKEN_FIELDS)
def test_token_ids_are_uint32_and_the_same_bytes_as_int64(cls: type, name: str) -> None:
    field = cls.DESCRIPTOR.fields_by_name[name]  # type: ignore[attr-defined]
    assert field.type == FieldDescriptor.TYPE_UINT32
    old_cls = _old_message(field.number, descriptor_pb2.FieldDescriptorProto.TYPE_INT64)

    old = old_cls(ids=IDS)
    new = cls()
    getattr(new, name).extend(IDS)
    assert new.SerializeToString() == old.SerializeToString()
    parsed = cls.FromString(old.SerializeToString())  # type: ignore[attr-defined]
    assert list(getattr(parsed, name)) == IDS
    assert list(old_cls.FromString(new.SerializeToString()).ids) == IDS


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.5])
def test_client_refuses_ids_the_field_cannot_carry_naming_the_field(bad: object) -> None:
    """Ids outside uint32 never reach the server: the client refuses them as the server
    refuses ids >= 2^31 (INVALID_ARGUMENT naming the field and the id's index)."""
    short = [5, bad]  # below the packing threshold: the repeated field
    long = [5] * 20 + [bad]  # packing fails, so the repeated field again
    calls = [
        (lambda ids: allocate_request("p", "r", ids, 1, 0, True), "new_token_ids"),
        (lambda ids: lookup_request("p", ids, None), "token_ids"),
        (lambda ids: StepBuilder("p").allocate("r", ids, 1).to_pb(), "token_ids"),
    ]
    for call, field in calls:
        for ids in (short, long):
            with pytest.raises(InvalidArgumentError) as err:
                call(ids)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details.startswith(f"{field}: ")
            assert f"[{len(ids) - 1}] is {bad!r}" in err.value.details


def test_ids_the_server_refuses_are_still_sent() -> None:
    """[2^31, 2^32) fits the field: the server's bound (and its message) decides."""
    request = allocate_request("p", "r", [1, 2**31], 2, 0, True)
    assert list(request.new_token_ids) == [1, 2**31]


@pytest.mark.parametrize(("cls", "name", "old_type"), POOL_FIGURES)
@pytest.mark.parametrize("value", [0, 1, 300, 2**31 - 1, 2**40])
def test_pool_figures_are_uint64_and_the_same_bytes_as_before(
    cls: type, name: str, old_type: int, value: int
) -> None:
    field = cls.DESCRIPTOR.fields_by_name[name]  # type: ignore[attr-defined]
    assert field.type == FieldDescriptor.TYPE_UINT64
    if old_type == _T.TYPE_INT32 and value >= 2**31:
        return  # the old int32 field could not carry it
    old_cls = _old_message(field.number, old_type, repeated=False)
    old = old_cls(ids=value)
    new = cls(**{name: value})
    assert new.SerializeToString() == old.SerializeToString()
    assert getattr(cls.FromString(old.SerializeToString()), name) == value  # type: ignore[attr-defined]
    assert old_cls.FromString(new.SerializeToString()).ids == value


def test_no_block_count_is_a_signed_64_bit_integer() -> None:
    """The convention kvcache.proto states: 64-bit block figures are uint64 (pool figures,
    counters); one request's or call's are int32 like block ids."""
    allowed = {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_UINT32}
    seen = []
    for module in (kvcache_pb2, admin_pb2, worker_pb2, specs_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                if "blocks" in field.name and field.type != FieldDescriptor.TYPE_MESSAGE:
                    seen.append(field.full_name)
                    assert field.type in allowed, field.full_name
    assert len(seen) >= 10, seen
