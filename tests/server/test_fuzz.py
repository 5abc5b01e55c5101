"""Malformed and adversarial requests across every RPC of the three services.

Hypothesis builds request messages from the protobuf descriptors (every field of every
message, with values biased to the boundaries and to names that exist, so calls interact:
the pool ``p``, a handful of request ids), plus hand-written edge cases. For each call:

- the reply is OK or one of the documented refusals, never INTERNAL or UNKNOWN;
- the pool's invariants hold afterwards: every block free or held (never both, never
  lost), reference counts equal to the block tables holding them, the prefix index
  consistent, free + used = total;

and at the end, freeing every live request gives every block back.

Bytes that do not parse as a request are sent to every method of the server and of the
router (``kvsvc router``), and calls of methods that do not exist: INVALID_ARGUMENT and
UNIMPLEMENTED, never UNKNOWN or INTERNAL, and no traceback in the log. The method lists
come from the service descriptors, so a method added later is covered.

The default run sends about 2,000 requests; ``KVSVC_SLOW=1`` adds ``test_fuzz_long``:
10,000 more.
"""

from __future__ import annotations

import logging
import os
import struct
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsvc.server.config import PoolConfig
from kvsvc.v1 import admin_pb2, cluster_pb2, kvcache_pb2, worker_pb2
from tests.core.core_factories import check_pool_invariants
from tests.server.harness import FakeRank, ServerThread, llama_like_specs, running_server

SERVICES = [
    kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"],
    worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
]
METHODS: list[MethodDescriptor] = [m for s in SERVICES for m in s.methods]
# What a refusal may be. INTERNAL and UNKNOWN are bugs; DEADLINE_EXCEEDED only for a
# stream that is (correctly) waiting for its next message.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
REQUEST_IDS = ["a", "b", "c", "r" * 300, "é" * 70, "x\x00y"]
POOLS = ["p", "p", "p", "waiting", "", "nope"]
BLOCK = 16

_INTS = st.one_of(
    st.integers(0, 64),
    st.sampled_from([-1, -(2**31), 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
_UINTS = st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32 - 1, 2**63, 2**64 - 1]))
_TOKENS = st.lists(st.integers(0, 50), min_size=0, max_size=80)


def _packed_tokens() -> st.SearchStrategy[bytes]:
    well_formed = _TOKENS.map(lambda ids: struct.pack(f"<{len(ids)}I", *ids))
    return st.one_of(well_formed, st.binary(max_size=64))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    name = field.name
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        if name == "pool":
            return st.sampled_from(POOLS)
        if "request_id" in name:
            return st.sampled_from(REQUEST_IDS)
        return st.one_of(st.sampled_from(["", "a", "x" * 1000]), st.text(max_size=20))
    if t == FieldDescriptor.TYPE_BYTES:
        if "token" in name:
            return _packed_tokens()
        return st.binary(max_size=40)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_ENUM:
        values = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(values), st.integers(-5, 200))
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.floats(allow_nan=True), st.sampled_from([0.0, -1.0, 1e300]))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.integers(0, 64), st.sampled_from([2**31, 2**32 - 1]))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return _UINTS
    if t in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SFIXED32,
    ):
        return st.one_of(st.integers(-2, 64), st.sampled_from([-(2**31), 2**31 - 1]))
    if "token" in name:
        return st.one_of(st.integers(0, 50), _INTS)
    return _INTS


def _message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """A dict of field values for ``descriptor`` (each field present or not)."""
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key = field.message_type.fields_by_name["key"]
            value = field.message_type.fields_by_name["value"]
            parts[field.name] = st.dictionaries(
                _scalar(key) if key.type != FieldDescriptor.TYPE_INT32 else st.integers(-2, 8),
                _message(value.message_type, depth + 1)
                if value.message_type is not None
                else _scalar(value),
                max_size=3,
            )
            continue
        if field.message_type is not None:
            if depth > 3:
                continue
            inner = _message(field.message_type, depth + 1)
            parts[field.name] = st.lists(inner, max_size=3) if _repeated(field) else inner
            continue
        if _repeated(field):
            if "token" in field.name:
                parts[field.name] = st.one_of(_TOKENS, st.lists(_INTS, max_size=5))
            elif field.type == FieldDescriptor.TYPE_STRING and "request_id" in field.name:
                parts[field.name] = st.lists(st.sampled_from(REQUEST_IDS), max_size=6)
            else:
                parts[field.name] = st.lists(_scalar(field), max_size=6)
            continue
        parts[field.name] = _scalar(field)
    return st.fixed_dictionaries({}, optional=parts)


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _fill(message: Any, values: dict[str, Any]) -> Any:
    """Set ``values`` on ``message``; values protobuf itself refuses (out of a field's
    range) are dropped, since they cannot be sent at all."""
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        try:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                target = getattr(message, name)
                for key, item in value.items():
                    if isinstance(item, dict):
                        _fill(target[key], item)
                    else:
                        target[key] = item
            elif field.message_type is not None:
                if _repeated(field):
                    for item in value:
                        _fill(getattr(message, name).add(), item)
                else:
                    _fill(getattr(message, name), value)
                    getattr(message, name).SetInParent()
            elif _repeated(field):
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        except (ValueError, TypeError):
            message.ClearField(name)
    return message


class Caller:
    """Raw calls of any method (the request class from the descriptor, no stubs)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)

    def __call__(self, method: MethodDescriptor, request: Any) -> grpc.StatusCode:
        path = f"/{method.containing_service.full_name}/{method.name}"
        response_class = method.output_type._concrete_class
        if method.server_streaming:
            call = self.channel.unary_stream(
                path, type(request).SerializeToString, response_class.FromString
            )
            stream = call(request, timeout=0.3)
            try:
                next(stream)
            except grpc.RpcError as exc:
                code = exc.code()
                return grpc.StatusCode.OK if code == grpc.StatusCode.DEADLINE_EXCEEDED else code
            except StopIteration:
                pass
            finally:
                stream.cancel()
            return grpc.StatusCode.OK
        unary = self.channel.unary_unary(
            path, type(request).SerializeToString, response_class.FromString
        )
        try:
            unary(request, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pools = (
        PoolConfig(name="p", world_size=1, max_model_len=256, max_requests=8),
        PoolConfig(name="waiting", world_size=2, max_model_len=256),
    )
    with running_server(*pools, event_buffer_batches=64) as srv:
        rank = FakeRank(srv.address, "p", 0, 1, llama_like_specs(), 40 * 32 * 1024)
        rank.register()
        rank.open_stream()
        assert not rank.wait_for_config().error
        rank.report()
        yield srv
        rank.close()


def _check_invariants(server: ServerThread) -> None:
    def check() -> None:
        cache = server.server.pools.get("p").cache
        tables = [group for rid in cache.request_ids() for group in cache.block_table(rid).groups]
        check_pool_invariants(cache.manager.block_pool, tables)
        usage = cache.usage()
        assert 0 <= usage.num_free_blocks <= usage.num_blocks

    server.run(check)


def _free_everything(server: ServerThread) -> None:
    def free() -> None:
        pool = server.server.pools.get("p")
        cache = pool.cache
        cache.free(list(cache.request_ids()))
        pool.drain_events()
        usage = cache.usage()
        assert usage.num_requests == 0
        assert usage.num_free_blocks == usage.num_blocks, "a block was lost"

    server.run(free)


# Hand-written cases the generator reaches rarely: boundaries and crafted combinations.
def _edge_cases() -> list[tuple[str, Any]]:
    kv = kvcache_pb2
    start = kv.RequestStart()
    huge = kv.RequestStart(
        hashing=kv.HashingContext(
            mm_items=[kv.MultiModalItem(identifier="i", offset=0, length=10**9)]
        )
    )
    return [
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p", request_id="e1", new_token_ids=[1] * 300, num_new_tokens=300, start=start
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p", request_id="e1", new_token_ids=[1] * 20, num_new_tokens=20, start=huge
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p",
                request_id="e1",
                packed_new_token_ids=b"\x01\x00\x00",
                num_new_tokens=1,
                start=start,
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p", request_id="e1", new_token_ids=[2**31], num_new_tokens=1, start=start
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p", request_id="e1", new_token_ids=[1, 2], num_new_tokens=-5, start=start
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p",
                request_id="e1",
                new_token_ids=[1, 2],
                num_new_tokens=2,
                num_lookahead_tokens=2**31 - 1,
                start=start,
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p",
                request_id="e2",
                new_token_ids=list(range(40)),
                num_new_tokens=40,
                start=start,
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p",
                request_id="e2",
                packed_new_token_ids=struct.pack("<300I", *[5] * 300),
                num_new_tokens=1,
            ),
        ),
        (
            "Allocate",
            kv.AllocateRequest(
                pool="p", request_id="e2", num_new_tokens=1, num_rejected_tokens=10**6
            ),
        ),
        ("Free", kv.FreeRequest(pool="p", request_ids=["e2", "e2"])),
        ("Free", kv.FreeRequest(pool="p", request_ids=["e2"], reason=99)),
        (
            "Step",
            kv.StepRequest(
                pool="p", types=[1, 1], request_ids=["s1"], num_token_ids=[1, 1], token_ids=[1, 2]
            ),
        ),
        (
            "Step",
            kv.StepRequest(
                pool="p",
                types=[1],
                request_ids=["s1"],
                num_token_ids=[2],
                token_ids=[1, 2],
                num_new_tokens=[2],
                starts={5: start},
            ),
        ),
        ("Step", kv.StepRequest(pool="p", types=[77], request_ids=["s1"])),
        (
            "Step",
            kv.StepRequest(
                pool="p", types=[1], request_ids=["s1"], num_token_ids=[-1], token_ids=[]
            ),
        ),
        ("Step", kv.StepRequest(pool="p", free_queue_head_limit=-1)),
        ("Step", kv.StepRequest(pool="p", free_queue_head_limit=2**31 - 1)),
        ("Lookup", kv.LookupRequest(pool="p", token_ids=[1] * 100_000)),
        ("Lookup", kv.LookupRequest(pool="p", packed_token_ids=b"\xff" * 8)),
        ("GetBlockTable", kv.GetBlockTableRequest(pool="p", request_id="")),
        ("WatchEvents", kv.WatchEventsRequest(pool="p", from_sequence=2**64 - 1)),
        ("WatchEvents", kv.WatchEventsRequest(pool="p", from_sequence=0, epoch="x")),
        (
            "Register",
            worker_pb2.RegisterRequest(
                pool="p",
                rank=0,
                world_size=1,
                memory=worker_pb2.MemoryProfile(kv_cache_bytes=2**62),
            ),
        ),
        ("Register", worker_pb2.RegisterRequest(pool="waiting", rank=5, world_size=2)),
        (
            "Register",
            worker_pb2.RegisterRequest(
                pool="waiting",
                rank=0,
                world_size=2,
                memory=worker_pb2.MemoryProfile(total_bytes=2**50, kv_cache_bytes=2**50),
            ),
        ),
        ("Heartbeat", worker_pb2.HeartbeatRequest(pool="p", rank=-1, session_id="é")),
        (
            "ReportAllocation",
            worker_pb2.ReportAllocationRequest(
                pool="p", rank=0, session_id="x", num_blocks=2**64 - 1
            ),
        ),
        ("WatchPlan", worker_pb2.WatchPlanRequest(pool="p", rank=2**31 - 1)),
        ("GetPlan", admin_pb2.GetPlanRequest(pool="")),
    ]


def test_hand_written_edge_cases(server: ServerThread) -> None:
    caller = Caller(server.address)
    by_name = {m.name: m for m in METHODS}
    for name, request in _edge_cases():
        code = caller(by_name[name], request)
        assert code in DOCUMENTED, (name, request, code)
        _check_invariants(server)
    _free_everything(server)


# Well-formed engine calls on the same few ids, mixed in so the malformed ones meet live
# requests, cached blocks and a full pool (random messages alone rarely admit anything).
_VALID_IDS = st.sampled_from(["a", "b", "c"])
_PROMPTS = st.lists(st.integers(0, 7), min_size=1, max_size=120)


def _valid_calls() -> st.SearchStrategy[tuple[str, Any]]:
    kv = kvcache_pb2
    admit = st.builds(
        lambda rid, prompt: kv.AllocateRequest(
            pool="p",
            request_id=rid,
            new_token_ids=prompt,
            num_new_tokens=len(prompt),
            start=kv.RequestStart(),
        ),
        _VALID_IDS,
        _PROMPTS,
    )
    decode = st.builds(
        lambda rid, token: kv.AllocateRequest(
            pool="p", request_id=rid, new_token_ids=[token], num_new_tokens=1
        ),
        _VALID_IDS,
        st.integers(0, 7),
    )
    step = st.builds(
        lambda ids: kv.StepRequest(
            pool="p",
            types=[kv.STEP_OPERATION_TYPE_ALLOCATE] * len(ids),
            request_ids=ids,
            num_token_ids=[1] * len(ids),
            token_ids=[3] * len(ids),
            num_new_tokens=[1] * len(ids),
        ),
        st.lists(_VALID_IDS, min_size=1, max_size=3, unique=True),
    )
    free = st.builds(
        lambda ids, preempt: kv.FreeRequest(
            pool="p",
            request_ids=ids,
            reason=kv.FREE_REASON_PREEMPTED if preempt else kv.FREE_REASON_FINISHED,
        ),
        st.lists(_VALID_IDS, min_size=1, max_size=2, unique=True),
        st.booleans(),
    )
    return st.one_of(
        admit.map(lambda r: ("Allocate", r)),
        decode.map(lambda r: ("Allocate", r)),
        step.map(lambda r: ("Step", r)),
        free.map(lambda r: ("Free", r)),
    )


def _fuzz(server: ServerThread, examples: int) -> None:
    caller = Caller(server.address)
    strategies = {m.full_name: _message(m.input_type) for m in METHODS}
    seen: Counter[tuple[str, str]] = Counter()
    valid = _valid_calls()
    by_name = {m.name: m for m in METHODS}

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(data=st.data())
    def one_call(data: st.DataObject) -> None:
        if data.draw(st.integers(0, 3), label="well-formed") == 0:
            name, request = data.draw(valid, label="call")
            method = by_name[name]
        else:
            method = data.draw(st.sampled_from(METHODS), label="method")
            values = data.draw(strategies[method.full_name], label="fields")
            request = _fill(method.input_type._concrete_class(), values)
        code = caller(method, request)
        seen[method.name, code.name] += 1
        assert code in DOCUMENTED, (method.name, request, code)
        _check_invariants(server)

    one_call()
    # Not vacuous: the generator reached the pool's state (admissions and steps that were
    # applied) as well as refusals.
    assert seen["Allocate", "OK"] and seen["Step", "OK"] and seen["Free", "OK"], seen
    assert seen["Allocate", "INVALID_ARGUMENT"] and seen["Step", "INVALID_ARGUMENT"], seen
    _free_everything(server)


def test_fuzz_every_rpc(server: ServerThread) -> None:
    _fuzz(server, 2000)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVSVC_SLOW"), reason="long fuzz: set KVSVC_SLOW=1")
def test_fuzz_long(server: ServerThread) -> None:
    _fuzz(server, 10_000)


# Bytes that no request message parses as: a truncated varint, a length past the end, a
# field number 0, a tag varint too long, a group that never ends, random noise.
MALFORMED_BODIES = [
    b"\x08\x80",
    b"\x0a\xff\xff\xff\xff\x0f",
    b"\x00",
    b"\xff" * 10 + b"\x01",
    b"\x0b",
    b"\x12\x05ab",
]
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
# Every method the server serves with a protobuf request (reflection's is a stream of
# requests: not a unary-request method), and the router's.
SERVER_METHODS: list[MethodDescriptor] = [*METHODS, *HEALTH.methods]
ROUTER_METHODS: list[MethodDescriptor] = [
    *cluster_pb2.DESCRIPTOR.services_by_name["ClusterIndexService"].methods,
    *HEALTH.methods,
]


def _raw_code(channel: grpc.Channel, path: str, body: bytes, streaming: bool) -> grpc.StatusCode:
    """The status of a call of ``path`` whose request body is ``body`` as it is."""
    try:
        if streaming:
            stream = channel.unary_stream(path)(body, timeout=5)
            try:
                next(stream)
            finally:
                stream.cancel()
        else:
            channel.unary_unary(path)(body, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in caplog.records
    ]
    assert "Traceback" not in caplog.text


def _check_malformed_and_unknown(
    address: str, methods: list[MethodDescriptor], caplog: pytest.LogCaptureFixture
) -> None:
    """Malformed bytes to every method: INVALID_ARGUMENT, one security-log line per
    method at most (rate-limited), no traceback; unknown methods: UNIMPLEMENTED."""
    caplog.set_level(logging.WARNING)
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(address) as channel:
        for method in methods:
            path = f"/{method.containing_service.full_name}/{method.name}"
            for body in MALFORMED_BODIES:
                code = _raw_code(channel, path, body, method.server_streaming)
                codes[code.name] += 1
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, body, code)
        services = {m.containing_service.full_name for m in methods}
        for service in services:
            for streaming in (False, True):
                code = _raw_code(channel, f"/{service}/Nope", b"", streaming)
                assert code == grpc.StatusCode.UNIMPLEMENTED, (service, code)
    assert codes == {"INVALID_ARGUMENT": len(methods) * len(MALFORMED_BODIES)}
    lines = [r.getMessage() for r in caplog.records if "malformed request" in r.getMessage()]
    assert 0 < len(lines) <= len(methods), lines
    _assert_no_traceback(caplog)


def test_malformed_bytes_and_unknown_methods_on_the_server(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    _check_malformed_and_unknown(server.address, SERVER_METHODS, caplog)
    _check_invariants(server)


def test_malformed_bytes_and_unknown_methods_on_the_router(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``kvsvc router`` (a synchronous gRPC server) answers alike; its Redis is never
    reached (the client points at nothing)."""
    import redis

    from kvsvc.cluster.router import create_router
    from kvsvc.cluster.score import Scorer

    router, port = create_router(
        Scorer(redis.Redis(port=1, socket_connect_timeout=0.5), "seed"), "127.0.0.1:0"
    )
    try:
        _check_malformed_and_unknown(f"127.0.0.1:{port}", ROUTER_METHODS, caplog)
    finally:
        router.stop(None)
