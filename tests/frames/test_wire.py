"""The framed protocol at the byte level, against a real server on real sockets.

What kvsvc's own client never sends is sent here by hand: frames over the bounds, headers
that do not parse, unknown and streaming methods, other protocol versions, too many
connections, another protocol's bytes. Each must be answered with an error frame that
names the problem (and the connection then closed, nothing more read), or for bytes of
another protocol no answer at all; a body that does not parse is answered without closing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvsvc.v1 import admin_pb2, kvcache_pb2
from kvsvc.wire.frames import MAGIC, MAX_HEADER_BYTES, PREFIX, call_header, frame
from tests.frames.helpers import ADMIN, KVCACHE, POOL, RawClient, frames_server, short_dir
from tests.server.harness import ServerThread

MAX_MESSAGE_BYTES = 4096
# gRPC status codes as FrameHeader.code carries them.
INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 3, 8, 12


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with (
        short_dir() as tmp,
        frames_server(f"unix:{tmp}/f.sock,127.0.0.1:0", max_message_bytes=MAX_MESSAGE_BYTES) as srv,
    ):
        yield srv


@pytest.fixture(params=["unix", "tcp"])
def address(request: pytest.FixtureRequest, server: ServerThread) -> str:
    if request.param == "unix":
        return server.server.frames_addresses[0]
    return f"127.0.0.1:{server.server.frames_port}"


def usage_body() -> bytes:
    return kvcache_pb2.GetUsageRequest(pool=POOL).SerializeToString()


def test_a_call_is_answered_with_its_reply_and_epoch(server: ServerThread, address: str) -> None:
    """The happy path by hand: the hello is answered with version 1 and code 0, a call
    with code 0, the pool's epoch as trailing metadata and the response message."""
    with RawClient(address) as raw:
        answer = raw.hello()
        assert (answer.version, answer.code, answer.close) == (1, 0, False)
        header, body = raw.call(KVCACHE + "GetUsage", usage_body())
        assert header.code == 0 and not header.close, header
        epoch = server.run(lambda: server.server.pools.by_name[POOL].events.epoch)
        assert [(m.key, m.value) for m in header.metadata] == [("kvsvc-epoch", epoch)]
        assert kvcache_pb2.GetUsageResponse.FromString(body).pool == POOL
        # Calls go one after another on the same connection.
        header, body = raw.call(
            ADMIN + "ListPools", admin_pb2.ListPoolsRequest().SerializeToString()
        )
        assert header.code == 0
        assert [p.name for p in admin_pb2.ListPoolsResponse.FromString(body).pools] == [POOL]


def test_a_header_over_the_bound_is_refused_unread(address: str) -> None:
    """A header length over 65536 is answered RESOURCE_EXHAUSTED at once (the header is
    never sent: the server must not wait for it) and the connection is closed."""
    with RawClient(address) as raw:
        raw.hello()
        raw.send(PREFIX.pack(MAX_HEADER_BYTES + 1, 0))
        header, body = raw.read()
        assert header.code == RESOURCE_EXHAUSTED and header.close and not body
        assert str(MAX_HEADER_BYTES + 1) in header.details
        assert str(MAX_HEADER_BYTES) in header.details
        assert raw.closed_by_server()


def test_a_body_over_max_message_bytes_is_refused_unread(address: str) -> None:
    """A body over the server's max_message_bytes is refused from its announced length,
    before any of it is sent."""
    with RawClient(address) as raw:
        raw.hello()
        method = call_header(KVCACHE + "GetUsage")
        raw.send(PREFIX.pack(len(method), MAX_MESSAGE_BYTES + 1) + method)
        header, _ = raw.read()
        assert header.code == RESOURCE_EXHAUSTED and header.close
        assert "max_message_bytes" in header.details
        assert str(MAX_MESSAGE_BYTES + 1) in header.details
        assert raw.closed_by_server()


def test_a_body_at_max_message_bytes_is_read(address: str) -> None:
    """The bound is inclusive: a body of exactly max_message_bytes is read and answered
    (the handler answers it, here an unknown pool; not RESOURCE_EXHAUSTED from the bound)."""
    body = kvcache_pb2.GetUsageRequest(pool="x" * (MAX_MESSAGE_BYTES - 3)).SerializeToString()
    assert len(body) == MAX_MESSAGE_BYTES, len(body)
    with RawClient(address) as raw:
        raw.hello()
        header, _ = raw.call(KVCACHE + "GetUsage", body)
        assert header.code not in (0, RESOURCE_EXHAUSTED), header
        assert not header.close


def test_a_header_that_does_not_parse_is_refused(address: str) -> None:
    with RawClient(address) as raw:
        raw.hello()
        raw.send(frame(b"\x12\x10ab"))  # field 2 (method) says 16 bytes; 2 follow
        header, _ = raw.read()
        assert header.code == INVALID_ARGUMENT and header.close
        assert "FrameHeader" in header.details
        assert raw.closed_by_server()


@pytest.mark.parametrize(
    "method",
    [
        "/kvsvc.v1.KVCacheService/NoSuchMethod",
        "/kvsvc.v1.KVCacheService/WatchEvents",
        "/kvsvc.v1.KVCacheService/SnapshotIndex",
        "/kvsvc.v1.AdminService/SnapshotPool",
        "/kvsvc.v1.WorkerService/Register",
        "/kvsvc.v1.WorkerService/Heartbeat",
        "/grpc.health.v1.Health/Check",
    ],
)
def test_methods_not_served_over_frames_are_unimplemented(address: str, method: str) -> None:
    """Unknown methods, streaming ones and the Worker service: UNIMPLEMENTED, naming the
    method, and the body (announced, never sent) is not waited for."""
    with RawClient(address) as raw:
        raw.hello()
        header_bytes = call_header(method)
        raw.send(PREFIX.pack(len(header_bytes), 1000) + header_bytes)
        header, _ = raw.read()
        assert header.code == UNIMPLEMENTED and header.close, header
        assert method in header.details and "gRPC" in header.details
        assert raw.closed_by_server()


def test_a_call_frame_without_a_method_is_unimplemented(address: str) -> None:
    with RawClient(address) as raw:
        raw.hello()
        raw.send(frame(b""))
        header, _ = raw.read()
        assert header.code == UNIMPLEMENTED and header.close
        assert "names no method" in header.details


def test_another_protocol_version_is_refused_in_the_hello(address: str) -> None:
    from kvsvc.v1.frames_pb2 import FrameHeader

    with RawClient(address) as raw:
        raw.send(MAGIC + frame(FrameHeader(version=2).SerializeToString()))
        header, _ = raw.read()
        assert header.code == UNIMPLEMENTED and header.close
        assert "version 2" in header.details and "version 1" in header.details
        assert raw.closed_by_server()


def test_a_hello_with_a_body_is_refused(address: str) -> None:
    from kvsvc.wire.frames import hello_header

    with RawClient(address) as raw:
        raw.send(MAGIC + frame(hello_header(None), b"x"))
        header, _ = raw.read()
        assert header.code == INVALID_ARGUMENT and header.close
        assert raw.closed_by_server()


@pytest.mark.parametrize(
    "preface", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]
)
def test_another_protocol_is_closed_without_a_reply(server: ServerThread, preface: bytes) -> None:
    """Wrong magic (gRPC's HTTP/2 preface, an HTTP/1 request): closed, nothing sent back;
    the listener goes on serving."""
    address = server.server.frames_addresses[0]
    with RawClient(address) as raw:
        raw.send(preface)
        assert raw.sock.recv(1 << 16) == b""
    with RawClient(address) as raw:
        assert raw.hello().code == 0
        assert raw.call(KVCACHE + "GetUsage", usage_body())[0].code == 0


def test_a_body_that_does_not_parse_leaves_the_connection_open(address: str) -> None:
    """The frame was whole, so the connection is still in step: INVALID_ARGUMENT without
    close, and the next call on the same connection is served."""
    with RawClient(address) as raw:
        raw.hello()
        header, body = raw.call(KVCACHE + "GetUsage", b"\x0a\x10ab")  # pool: 16 bytes, 2 sent
        assert header.code == INVALID_ARGUMENT and not header.close and not body
        assert "does not parse" in header.details
        header, body = raw.call(KVCACHE + "GetUsage", usage_body())
        assert header.code == 0, header
        assert kvcache_pb2.GetUsageResponse.FromString(body).pool == POOL


def test_an_unknown_pool_is_answered_without_close(address: str) -> None:
    """A handler's error is a reply like any other: NOT_FOUND, close not set."""
    with RawClient(address) as raw:
        raw.hello()
        body = kvcache_pb2.GetUsageRequest(pool="nope").SerializeToString()
        header, _ = raw.call(KVCACHE + "GetUsage", body)
        assert header.code == 5 and not header.close and "nope" in header.details
        assert raw.call(KVCACHE + "GetUsage", usage_body())[0].code == 0


def test_connections_past_frames_max_connections_are_refused_in_the_hello() -> None:
    """With frames_max_connections=2 the third connection's hello is answered
    RESOURCE_EXHAUSTED naming the setting; once one closes a new one is served."""
    with short_dir() as tmp, frames_server(f"unix:{tmp}/m.sock", frames_max_connections=2) as srv:
        address = srv.server.frames_addresses[0]
        first, second = RawClient(address), RawClient(address)
        try:
            assert first.hello().code == 0 and second.hello().code == 0
            with RawClient(address) as third:
                answer = third.hello()
                assert answer.code == RESOURCE_EXHAUSTED and answer.close
                assert "frames_max_connections" in answer.details
                assert third.closed_by_server()
            # The two admitted ones still serve.
            assert first.call(KVCACHE + "GetUsage", usage_body())[0].code == 0
            assert second.call(KVCACHE + "GetUsage", usage_body())[0].code == 0
            first.close()
            deadline = time.monotonic() + 5
            while True:  # the server notices the close on its loop
                with RawClient(address) as again:
                    if again.hello().code == 0:
                        assert again.call(KVCACHE + "GetUsage", usage_body())[0].code == 0
                        break
                assert time.monotonic() < deadline, "a closed connection's slot never freed"
                time.sleep(0.05)
        finally:
            first.close()
            second.close()
