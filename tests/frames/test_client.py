"""kvsvc's typed client over the framed transport, against a real in-process server
(fake ranks over gRPC make its pool READY): the engine calls, errors, deadlines, many
threads on one client, a stop, and what the client says about addresses that are not a
frames listener."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvsvc_client import (
    ClientOptions,
    FreeResult,
    InvalidArgumentError,
    KVCacheClient,
    KVCacheError,
    NotFoundError,
    OperationError,
    UnavailableError,
)
from kvsvc_client._frames import FrameChannel
from prometheus_client import CollectorRegistry

from kvsvc.wire.frames import PREFIX
from tests.frames.helpers import (
    POOL,
    QUICK,
    frames_server,
    live_requests,
    short_dir,
    target_of,
    tcp_target,
    unix_target,
)
from tests.server.harness import ServerThread

BIG = 2**31  # the first token id out of bounds


def pool_epoch(server: ServerThread) -> str:
    return str(server.run(lambda: server.server.pools.by_name[POOL].events.epoch))


def test_the_engine_sequence_over_frames_matches_grpc(server: ServerThread, target: str) -> None:
    """Allocate, a Step of several operations, lookup, block table, usage, reset and free
    over frames; each change is visible over gRPC and the other way round, and the epoch
    the frames client notes is the pool's, as the gRPC client notes it."""
    with (
        KVCacheClient(target, pool=POOL) as kv,
        KVCacheClient(server.address, pool=POOL) as over_grpc,
    ):
        assert kv.wait_until_ready(timeout=10).state == "READY"
        assert [p.name for p in kv.list_pools()] == [POOL]
        empty = kv.usage()
        assert kv.epoch == pool_epoch(server)
        prompt = list(range(1, 40))
        first = kv.allocate("r1", prompt, 39, start=True)
        assert first.ok and len(first.new_block_ids[0]) == 3
        step = kv.step()
        step.allocate("r1", [40], 1)
        step.allocate("r2", prompt, 39, start=True)
        step.allocate("r3", list(range(900, 917)), 17, start=True)
        step.free("r3")
        results = step.send()
        assert [r.ok for r in results[:3]] == [True, True, True]
        assert isinstance(results[3], FreeResult) and results[3].num_freed_blocks >= 1
        assert results[1].num_cached_tokens == 32  # r1's two full blocks
        assert kv.lookup(prompt) == 32
        assert kv.lookup(list(range(2000, 2040))) == 0
        table = kv.block_table("r1")
        assert table.num_tokens == 40 and table.num_computed_tokens == 40
        assert over_grpc.block_table("r1") == table
        assert over_grpc.block_table("r2") == kv.block_table("r2")
        assert kv.usage() == over_grpc.usage()
        assert kv.usage().num_requests == 2
        # A change over gRPC is seen over frames.
        assert over_grpc.allocate("r1", [41], 1).ok
        assert kv.block_table("r1").num_tokens == 41
        assert over_grpc.epoch == kv.epoch == pool_epoch(server)
        assert kv.reset_prefix_cache() is False  # live requests hold cached blocks
        assert kv.free("r1", "r2") > 0
        assert over_grpc.usage().num_requests == 0
        assert kv.reset_prefix_cache() is True
        assert kv.lookup(prompt) == 0
        after = kv.usage()
        assert after.num_free_blocks == empty.num_free_blocks
        assert after.num_cached_blocks == 0
        assert kv.get_plan().pool.name == POOL


def failure(call: Callable[[], object]) -> tuple[type[KVCacheError], grpc.StatusCode, str]:
    """How ``call`` failed: the error's type, code and message."""
    with pytest.raises(KVCacheError) as caught:
        call()
    return type(caught.value), caught.value.code, caught.value.details


def test_errors_keep_their_codes_and_messages_and_change_nothing(
    server: ServerThread, target: str
) -> None:
    """Each bad call fails over frames exactly as over gRPC (type, code, message), names
    the pool or field, changes no state, and the client goes on after it."""
    with (
        KVCacheClient(target, pool="nope", options=QUICK) as wrong,
        KVCacheClient(server.address, pool="nope", options=QUICK) as wrong_grpc,
    ):
        for make in (
            lambda kv: kv.usage(),
            lambda kv: kv.allocate("x", [1, 2, 3], 3, start=True),
        ):
            kind, code, details = failure(lambda make=make: make(wrong))  # type: ignore[misc]
            assert (kind, code) == (NotFoundError, grpc.StatusCode.NOT_FOUND)
            assert "nope" in details
            assert failure(lambda make=make: make(wrong_grpc)) == (kind, code, details)  # type: ignore[misc]
    with (
        KVCacheClient(target, pool=POOL, options=QUICK) as kv,
        KVCacheClient(server.address, pool=POOL, options=QUICK) as over_grpc,
    ):
        before = kv.usage()
        cases: list[tuple[Callable[[KVCacheClient], object], type[KVCacheError], str]] = [
            (lambda c: c.allocate("", [1, 2], 2, start=True), InvalidArgumentError, "request_id"),
            (lambda c: c.allocate("b", [1, BIG], 2, start=True), InvalidArgumentError, str(BIG)),
            (lambda c: c.lookup([5, 2**31]), InvalidArgumentError, "token_ids"),
            (lambda c: c.block_table("ghost"), NotFoundError, '"ghost"'),
        ]  # fmt: skip
        for make, kind, named in cases:
            got = failure(lambda make=make: make(kv))  # type: ignore[misc]
            assert got[0] is kind and named in got[2], got
            assert failure(lambda make=make: make(over_grpc)) == got  # type: ignore[misc]
        assert live_requests(server) == []
        after = kv.usage()
        assert (after.num_free_blocks, after.num_requests) == (
            before.num_free_blocks,
            before.num_requests,
        )
        # The same client goes on: the errors did not break its connection.
        assert kv.allocate("ok", [1, 2, 3], 3, start=True).ok
        assert kv.free("ok") >= 0
        # A Step's malformed operation fails alone, with the message gRPC gives it.
        errors = []
        for client in (kv, over_grpc):
            step = client.step()
            step.allocate("s1", [1, 2, 3], 3, start=True)
            step.allocate("", [1], 1, start=True)
            admitted, refused = step.send()
            assert admitted.ok and isinstance(refused, OperationError)
            errors.append(refused)
            assert client.free("s1") >= 0
        assert errors[0] == errors[1]
        assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT
        assert errors[0].message == "operation 1's request id: must not be empty"


def test_a_client_at_a_missing_socket_is_unavailable_naming_it() -> None:
    with (
        KVCacheClient("frames:unix:/nonexistent/kf.sock", pool=POOL, options=QUICK) as kv,
        pytest.raises(UnavailableError, match=re.escape("/nonexistent/kf.sock")),
    ):
        kv.usage()


def test_a_frames_client_at_a_grpc_port_says_it_is_not_a_frames_listener(
    server: ServerThread,
) -> None:
    with (
        KVCacheClient(f"frames:{server.address}", pool=POOL, options=QUICK) as kv,
        pytest.raises(UnavailableError, match="did not answer the framed protocol's hello"),
    ):
        kv.usage()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_grpc_client_at_a_frames_listener_fails_and_the_listener_stays_up(
    server: ServerThread, transport: str
) -> None:
    frames = target_of(transport, server)
    grpc_target = frames.removeprefix("frames:")
    options = ClientOptions(timeout=2, retries=0, unavailable_timeout=0.0)
    with (
        KVCacheClient(grpc_target, pool=POOL, options=options) as wrong,
        pytest.raises(UnavailableError),
    ):
        wrong.usage()
    with KVCacheClient(frames, pool=POOL, options=QUICK) as kv:
        assert kv.usage().pool == POOL


def test_streaming_calls_on_a_frames_client_are_unimplemented(server: ServerThread) -> None:
    """watch_events and snapshot need gRPC: UNIMPLEMENTED, saying so; snapshot leaves no
    file behind."""
    with KVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv:
        with pytest.raises(Exception) as caught:  # the type: see the next test
            next(kv.watch_events())
        error = caught.value
        code = error.code if isinstance(error, KVCacheError) else error.code()  # type: ignore[attr-defined]
        assert code == grpc.StatusCode.UNIMPLEMENTED
        assert "served over gRPC only" in str(error)
        with short_dir() as tmp:
            with pytest.raises(KVCacheError, match="served over gRPC only") as snap:
                kv.snapshot(tmp / "snap")
            assert snap.value.code == grpc.StatusCode.UNIMPLEMENTED
            assert list(tmp.iterdir()) == []
        assert kv.usage().pool == POOL


def test_watch_events_on_a_frames_client_raises_a_typed_error(server: ServerThread) -> None:
    """Every other call of the typed client raises a kvsvc_client error; so must this."""
    with (
        KVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv,
        pytest.raises(KVCacheError) as caught,
    ):
        next(kv.watch_events())
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_a_passed_deadline_is_unavailable_and_the_next_call_succeeds(
    server: ServerThread, target: str
) -> None:
    """The server's loop is held for 1 s: a 0.2 s call fails with DEADLINE_EXCEEDED
    (UnavailableError) in about its deadline; the next call on the same client is served
    on a new connection (the old one's reply would come out of turn)."""
    with KVCacheClient(target, pool=POOL, options=QUICK) as kv:
        assert kv.usage().pool == POOL  # a connection open and idle
        server.loop.call_soon_threadsafe(time.sleep, 1.0)
        time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(UnavailableError) as caught:
            kv.usage(timeout=0.2)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 0.9
        assert kv.usage().pool == POOL
        assert kv.usage().pool == POOL


def test_a_deadline_that_passes_before_the_reply_is_deadline_exceeded(
    server: ServerThread,
) -> None:
    """A deadline shorter than the server's answer (here 1 us while the loop is held) is
    DEADLINE_EXCEEDED as over gRPC: not UNAVAILABLE, which a client retries differently
    (lookups and reads are retried on UNAVAILABLE only)."""
    with KVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv:
        assert kv.usage().pool == POOL
        server.loop.call_soon_threadsafe(time.sleep, 0.5)
        time.sleep(0.05)
        try:
            with pytest.raises(UnavailableError) as caught:
                kv.usage(timeout=1e-6)
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
        finally:
            time.sleep(0.6)


def test_a_retried_allocate_after_a_deadline_is_applied_once(
    server: ServerThread, target: str
) -> None:
    """The loop is held past the call's deadline: the client retries on new connections
    (the call id goes with it), and once the server runs again the token is counted once,
    whether the original or the retry is applied first."""
    options = ClientOptions(timeout=0.3, retries=10, backoff=0.05, max_backoff=0.1)
    with KVCacheClient(target, pool=POOL, options=options) as kv:
        assert kv.allocate("d1", list(range(1, 21)), 20, start=True).ok
        try:
            server.loop.call_soon_threadsafe(time.sleep, 1.0)
            time.sleep(0.05)
            result = kv.allocate("d1", [21], 1)
            assert result.ok and result.num_computed_tokens == 21, result
            assert kv.block_table("d1").num_tokens == 21
        finally:
            kv.free("d1")


def test_threads_sharing_one_client_each_get_their_answers(server: ServerThread) -> None:
    """8 threads x 200 allocate/step/free cycles on one frames client: every call succeeds,
    the pool ends with every block free, and the calls ran on several connections."""
    errors: list[BaseException] = []
    with KVCacheClient(unix_target(server), pool=POOL) as kv:
        before = kv.usage()

        def cycles(worker: int) -> None:
            try:
                for i in range(200):
                    rid = f"t{worker}-{i}"
                    prompt = [1 + worker, 100 + i % 50, 7, 8, 9]
                    assert kv.allocate(rid, prompt, 5, start=True).ok
                    step = kv.step()
                    step.allocate(rid, [worker + 1000], 1)
                    (grown,) = step.send()
                    assert grown.ok and grown.num_computed_tokens == 6, grown
                    assert kv.block_table(rid).num_tokens == 6
                    kv.free(rid)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=cycles, args=(w,)) for w in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors[0]
        after = kv.usage()
        assert after.num_requests == 0
        assert after.num_free_blocks == before.num_free_blocks
        channel = kv._channel
        assert isinstance(channel, FrameChannel)
        assert sum(len(idle) for idle in channel._idle.values()) > 1


def test_calls_after_a_stop_are_unavailable_without_hanging() -> None:
    with short_dir() as tmp, frames_server(f"unix:{tmp}/s.sock,127.0.0.1:0") as srv:
        targets = [unix_target(srv), tcp_target(srv)]
        options = ClientOptions(timeout=2, retries=1, backoff=0.01, unavailable_timeout=0.2)
        clients = [KVCacheClient(t, pool=POOL, options=options) for t in targets]
        try:
            for kv in clients:
                assert kv.usage().pool == POOL  # idle connections left open
            srv.stop()
            for kv in clients:
                started = time.monotonic()
                with pytest.raises(UnavailableError):
                    kv.usage()
                with pytest.raises(UnavailableError):
                    kv.allocate("late", [1, 2], 2, start=True)
                assert time.monotonic() - started < 3
        finally:
            for kv in clients:
                kv.close()
            srv.stop = lambda: None  # type: ignore[method-assign]  # stopped above


def test_a_clean_stop_leaves_no_frames_socket_behind() -> None:
    with short_dir() as tmp:
        path = Path(tmp) / "g.sock"
        with frames_server(f"unix:{path}", ready=False):
            assert path.is_socket()
        assert not path.exists()


def test_a_peer_that_breaks_the_protocol_is_unavailable_not_a_crash() -> None:
    """A listener that answers the hello with a frame whose header does not parse: the
    client reports UNAVAILABLE (a typed error), not a protobuf DecodeError."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer() -> None:
        peer, _ = listener.accept()
        with peer:
            peer.recv(1 << 16)
            peer.sendall(PREFIX.pack(3, 0) + b"\x12\x10a")
            peer.recv(1 << 16)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        target = f"frames:127.0.0.1:{listener.getsockname()[1]}"
        with KVCacheClient(target, pool=POOL, options=QUICK) as kv:
            _expect_unavailable(kv)
    finally:
        listener.close()


def _expect_unavailable(kv: KVCacheClient) -> None:
    with pytest.raises(UnavailableError, match="did not answer the framed protocol's hello"):
        kv.usage()


def test_frames_calls_are_counted_in_the_grpc_metrics() -> None:
    """grpc_server_handled_total counts framed calls as gRPC calls: by method and code."""
    registry = CollectorRegistry()
    token = "all-roles-token-0123456789"
    with (
        short_dir() as tmp,
        frames_server(
            f"unix:{tmp}/m.sock",
            token=token,
            auth_token=token,
            server_kwargs={"metrics_registry": registry},
        ) as srv,
    ):

        def handled(method: str, code: str) -> float:
            labels = {
                "grpc_type": "unary",
                "grpc_service": "kvsvc.v1.KVCacheService",
                "grpc_method": method,
                "grpc_code": code,
            }
            return registry.get_sample_value("grpc_server_handled_total", labels) or 0.0

        ok = ClientOptions(token=token, retries=0)
        with (
            KVCacheClient(unix_target(srv), pool=POOL, options=ok) as kv,
            KVCacheClient(srv.address, pool=POOL, options=ok) as over_grpc,
        ):
            for _ in range(3):
                kv.usage()
            over_grpc.usage()
            with pytest.raises(NotFoundError):
                kv.block_table("ghost")
            assert kv.allocate("m1", [1, 2, 3], 3, start=True).ok
            kv.free("m1")
        with (
            KVCacheClient(unix_target(srv), pool=POOL, options=QUICK) as anon,
            pytest.raises(KVCacheError),
        ):
            anon.usage()
        assert handled("GetUsage", "OK") == 4
        assert handled("GetBlockTable", "NOT_FOUND") == 1
        assert handled("Allocate", "OK") == 1 and handled("Free", "OK") == 1
        # Refused at its hello (no token): a connection refused, not a call of GetUsage
        # (the security log has it).
        assert handled("GetUsage", "UNAUTHENTICATED") == 0
