"""Bounds on gRPC calls in flight, per kind of caller (kvsvc.server.transports.gate):
engines' unary calls by count and request bytes, agents' calls and subscribers' streams
each on their own.

The calls are held in flight deterministically: the test takes the pool's lock on the
server's loop, so every Lookup waits for it inside its handler, then releases it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from kvsvc.server.config import ConfigError, PoolConfig, ServerConfig
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import FakeRank, ServerThread, bring_up, running_server

MAX_CALLS = 2
MESSAGE_BYTES = 64 * 1024
# Two 40 KB Lookups do not fit the byte bound together; two small ones do.
BIG_PROMPT = 10_000
TOKEN = 1 << 22  # 4 bytes a token on the wire: a big Lookup is 40 KB


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pool = PoolConfig(name="p", max_model_len=16_384)
    with running_server(
        pool,
        max_inflight_calls=MAX_CALLS,
        max_message_bytes=MESSAGE_BYTES,
        max_inflight_request_bytes=MESSAGE_BYTES,
        max_inflight_agent_calls=2,  # the rank's plan stream and one call
        max_inflight_streams=1,
    ) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=1100 * 32 * 1024)
        srv.ranks = ranks  # type: ignore[attr-defined]
        yield srv
        for rank in ranks:
            rank.close()


class _Held:
    """The pool's lock, held on the server's loop until released."""

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.lock = server.server.pools.get("p").lock

    def __enter__(self) -> _Held:
        self.server.call(self.lock.acquire())
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.run(self.lock.release)


def _lookup(stub: kvcache_pb2_grpc.KVCacheServiceStub, tokens: int) -> grpc.StatusCode:
    try:
        stub.Lookup(kvcache_pb2.LookupRequest(pool="p", token_ids=[TOKEN] * tokens), timeout=20)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _wait_inflight(
    server: ServerThread, kind: str, count: int, unless: Future[grpc.StatusCode] | None = None
) -> None:
    """Until ``count`` calls of ``kind`` are in flight (or the call ``unless`` ended)."""
    deadline = time.monotonic() + 10
    while server.run(lambda: server.server.gate.inflight[kind]) < count:  # type: ignore[union-attr]
        if unless is not None and unless.done():
            return
        assert time.monotonic() < deadline, f"{count} {kind} calls never got in flight"
        time.sleep(0.01)


def test_engine_calls_past_the_bound_are_refused_and_the_rest_served(
    server: ServerThread,
) -> None:
    with grpc.insecure_channel(server.address) as channel, ThreadPoolExecutor(4) as pool:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        with _Held(server):
            held: list[Future[grpc.StatusCode]] = [
                pool.submit(_lookup, stub, 32) for _ in range(MAX_CALLS)
            ]
            _wait_inflight(server, "engine", MAX_CALLS)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetUsage(kvcache_pb2.GetUsageRequest(pool="p"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_calls=2" in refused.value.details()
            # An agent's call is counted apart: served while the engines' are at the bound.
            rank: FakeRank = server.ranks[0]  # type: ignore[attr-defined]
            assert not rank.heartbeat().reregister
        assert [f.result(20) for f in held] == [grpc.StatusCode.OK] * MAX_CALLS
        # Nothing stays counted: the bound admits again.
        assert _lookup(stub, 32) == grpc.StatusCode.OK
    inflight = server.run(lambda: dict(server.server.gate.inflight))  # type: ignore[union-attr]
    assert inflight == {"engine": 0, "agent": 1, "stream": 0}  # agent: the plan stream


def test_request_bytes_in_flight_are_bounded(server: ServerThread) -> None:
    """One large Lookup in flight: a second one that would pass
    max_inflight_request_bytes is refused naming it; a small one still fits."""
    with grpc.insecure_channel(server.address) as channel, ThreadPoolExecutor(2) as pool:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        with _Held(server):
            first = pool.submit(_lookup, stub, BIG_PROMPT)
            _wait_inflight(server, "engine", 1)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Lookup(
                    kvcache_pb2.LookupRequest(pool="p", token_ids=[TOKEN] * BIG_PROMPT), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_request_bytes" in refused.value.details()
            small = pool.submit(_lookup, stub, 8)
            _wait_inflight(server, "engine", 2)
        assert first.result(20) == grpc.StatusCode.OK
        assert small.result(20) == grpc.StatusCode.OK


def test_the_bytes_of_calls_that_ended_leave_the_bound(server: ServerThread) -> None:
    """Calls one after another, more bytes in all than max_inflight_request_bytes: each
    leaves the count as it ends, so two small calls still overlap on the idle server
    (once the bytes stayed counted, every overlapping call was refused for good)."""
    with grpc.insecure_channel(server.address) as channel, ThreadPoolExecutor(2) as pool:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        for _ in range(3):  # 3 x 40 KB, one at a time, past the 64 KB bound in all
            assert _lookup(stub, BIG_PROMPT) == grpc.StatusCode.OK
        assert server.run(lambda: server.server.gate.inflight_bytes) == 0  # type: ignore[union-attr]
        with _Held(server):
            first = pool.submit(_lookup, stub, 8)
            _wait_inflight(server, "engine", 1)
            second = pool.submit(_lookup, stub, 8)
            _wait_inflight(server, "engine", 2, unless=second)
        assert (first.result(20), second.result(20)) == (grpc.StatusCode.OK,) * 2


def test_streams_are_bounded_apart_from_unary_calls(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        first = stub.WatchEvents(
            kvcache_pb2.WatchEventsRequest(pool="p", send_caught_up=True), timeout=20
        )
        try:
            assert next(first).caught_up  # open: it holds the one stream allowed
            second = stub.WatchEvents(kvcache_pb2.WatchEventsRequest(pool="p"), timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                next(second)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_inflight_streams=1" in refused.value.details()
            assert _lookup(stub, 8) == grpc.StatusCode.OK  # unary calls are not streams
        finally:
            first.cancel()


def test_the_byte_bound_must_admit_the_largest_message() -> None:
    with pytest.raises(ConfigError, match="max_inflight_request_bytes"):
        ServerConfig(
            pools=(PoolConfig(name="p"),),
            max_message_bytes=1 << 20,
            max_inflight_request_bytes=1 << 19,
        )
