"""The framed transport's auth: the same credentials, roles and engine namespaces as gRPC
(one rule, :func:`kvsvc.server.transports.auth.decide`), and a refused call answered
before its message is read."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from kvsvc_client import (
    ClientOptions,
    KVCacheClient,
    NotFoundError,
    PermissionDeniedError,
    RequestStart,
    UnauthenticatedError,
)

from kvsvc.v1 import kvcache_pb2
from kvsvc.v1.frames_pb2 import FrameHeader, FrameMetadata
from kvsvc.wire.frames import PREFIX, call_header, frame
from tests.frames.helpers import (
    KVCACHE,
    POOL,
    RawClient,
    frames_server,
    live_requests,
    short_dir,
    token_server,
    unix_target,
)
from tests.server.harness import ServerThread

ENGINE_A = "engine-a-token-0123456789"
ENGINE_B = "engine-b-token-0123456789"
AGENT = "agent-token-0123456789abc"
ADMIN = "admin-token-0123456789abc"
UNAUTHENTICATED = 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    tokens = {
        "engine": f"engine-a {ENGINE_A}\nengine-b {ENGINE_B}\n",
        "agent": f"{AGENT}\n",
        "admin": f"{ADMIN}\n",
    }
    with short_dir() as tmp, token_server("unix:{tmp}/a.sock,127.0.0.1:0", tmp, tokens) as srv:
        yield srv


def client(server: ServerThread, token: str) -> KVCacheClient:
    options = ClientOptions(token=token, retries=0, timeout=5)
    return KVCacheClient(unix_target(server), pool=POOL, options=options)


def test_a_call_without_a_token_is_unauthenticated(server: ServerThread) -> None:
    with client(server, "") as anon, pytest.raises(UnauthenticatedError) as caught:
        anon.usage()
    assert "missing authorization metadata" in caught.value.details
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_an_unknown_token_is_unauthenticated(server: ServerThread) -> None:
    with client(server, "not-a-token-0123456789") as stranger:
        with pytest.raises(UnauthenticatedError, match="unknown token"):
            stranger.allocate("x", [1, 2, 3], 3, start=True)
        # The secret is not echoed back.
        with pytest.raises(UnauthenticatedError) as caught:
            stranger.usage()
        assert "not-a-token-0123456789" not in caught.value.details
    assert live_requests(server) == []


def test_an_agent_token_cannot_make_engine_calls(server: ServerThread) -> None:
    with client(server, AGENT) as agent, pytest.raises(PermissionDeniedError) as caught:
        agent.allocate("x", [1, 2, 3], 3, start=True)
    # Refused at the hello: an agent's token may make no framed call at all.
    assert "needs the admin/engine role; this token is agent" in caught.value.details
    assert AGENT not in caught.value.details
    assert live_requests(server) == []


def test_an_admin_token_reads_but_does_not_allocate(server: ServerThread) -> None:
    with client(server, ADMIN) as admin:
        assert admin.usage().pool == POOL
        assert [p.name for p in admin.list_pools()] == [POOL]
        with pytest.raises(PermissionDeniedError, match="Allocate"):
            admin.allocate("x", [1, 2, 3], 3, start=True)
        # The refusal closed that connection; the next call opens another and is served.
        assert admin.usage().pool == POOL
    assert live_requests(server) == []


def test_named_engines_have_separate_namespaces(server: ServerThread) -> None:
    """Engine A's request is invisible to engine B over frames, B may use the same id, and
    messages show the engine its own id without the namespace prefix."""
    prompt = list(range(500, 540))
    with client(server, ENGINE_A) as a, client(server, ENGINE_B) as b:
        assert a.allocate("r1", prompt, 40, start=RequestStart()).ok
        try:
            with pytest.raises(NotFoundError, match='request "r1" is not live') as caught:
                b.block_table("r1")
            assert "engine-a" not in caught.value.details
            assert "\\u0000" not in caught.value.details and "\x00" not in caught.value.details
            with pytest.raises(NotFoundError):
                b.free("r1")
            with pytest.raises(NotFoundError) as own:
                a.block_table("r2")
            assert "engine-a" not in own.value.details and '"r2"' in own.value.details
            assert b.allocate("r1", prompt, 40, start=RequestStart()).ok
            assert a.block_table("r1").num_tokens == 40
            assert b.block_table("r1").num_tokens == 40
            assert len(live_requests(server)) == 2
            assert a.free("r1") > 0
            assert b.block_table("r1").num_tokens == 40
        finally:
            a.free("r1")
            b.free("r1")
    assert live_requests(server) == []


@pytest.mark.parametrize("transport", ["unix", "tcp"])
@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        (None, "missing authorization metadata"),
        ((("authorization", "Bearer not-a-token-0123456789"),), "unknown token"),
    ],
)
def test_a_hello_without_a_known_token_is_refused_and_closed(
    server: ServerThread,
    transport: str,
    metadata: tuple[tuple[str, str], ...] | None,
    reason: str,
) -> None:
    """When the server has tokens, a connection whose hello carries none it knows could
    make no call: its hello is answered UNAUTHENTICATED with close, and the connection is
    closed (it holds no slot)."""
    address = (
        server.server.frames_addresses[0]
        if transport == "unix"
        else f"127.0.0.1:{server.server.frames_port}"
    )
    with RawClient(address) as raw:
        answer = raw.hello(metadata)
        assert answer.code == UNAUTHENTICATED and answer.close
        assert reason in answer.details and "not-a-token" not in answer.details
        assert raw.closed_by_server()


def test_a_refused_call_with_a_token_of_another_role_is_not_read_either(
    server: ServerThread,
) -> None:
    with RawClient(server.server.frames_addresses[0]) as raw:
        raw.hello((("authorization", f"Bearer {ADMIN}"),))
        header = call_header(KVCACHE + "Allocate")
        raw.send(PREFIX.pack(len(header), 48 << 20) + header)
        reply, _ = raw.read()
        assert reply.code == 7 and reply.close  # PERMISSION_DENIED
        assert raw.closed_by_server()


def test_an_engine_token_is_served_on_a_raw_connection(server: ServerThread) -> None:
    """The hello's metadata authorizes every call of the connection."""
    with RawClient(server.server.frames_addresses[0]) as raw:
        raw.hello((("authorization", f"Bearer {ENGINE_A}"),))
        for _ in range(3):
            body = kvcache_pb2.GetUsageRequest(pool=POOL).SerializeToString()
            reply, data = raw.call(KVCACHE + "GetUsage", body)
            assert reply.code == 0, reply
            assert kvcache_pb2.GetUsageResponse.FromString(data).pool == POOL


def test_a_connection_decides_its_calls_by_its_own_token(server: ServerThread) -> None:
    """A connection decides each call's header once and keeps the answer, for itself: the
    same header bytes an engine's connection was served on are refused on an admin's, and
    an engine's own namespace stays its own on every later call."""
    free = KVCACHE + "Free"
    body = kvcache_pb2.FreeRequest(pool=POOL, request_ids=["nobody"]).SerializeToString()
    with RawClient(server.server.frames_addresses[0]) as engine:
        engine.hello((("authorization", f"Bearer {ENGINE_A}"),))
        for _ in range(3):
            reply, _ = engine.call(free, body)
            assert reply.code == 5 and "engine-a" not in reply.details  # NOT_FOUND
        with RawClient(server.server.frames_addresses[0]) as admin:
            admin.hello((("authorization", f"Bearer {ADMIN}"),))
            reply, _ = admin.call(free, body)
            assert reply.code == 7 and reply.close  # PERMISSION_DENIED
        reply, _ = engine.call(free, body)  # the engine's connection is still served
        assert reply.code == 5
    with client(server, ENGINE_A) as a, client(server, ENGINE_B) as b:
        assert a.allocate("mine", list(range(1, 33)), 32, start=True).ok
        try:
            for _ in range(3):
                with pytest.raises(NotFoundError):
                    b.free("mine")
                assert a.block_table("mine").num_tokens == 32
        finally:
            a.free("mine")
    assert live_requests(server) == []


def test_a_connection_keeps_few_and_small_call_headers(server: ServerThread) -> None:
    """The decisions a connection keeps are bounded: a large header (metadata a client
    pads it with) is served, and decided afresh each time, not kept."""
    usage = KVCACHE + "GetUsage"
    body = kvcache_pb2.GetUsageRequest(pool=POOL).SerializeToString()
    padded = FrameHeader(
        method=usage, metadata=[FrameMetadata(key="x-pad", value="p" * 1000)]
    ).SerializeToString()

    def kept() -> list[list[int]]:
        frames = server.server._frames
        assert frames is not None
        return [sorted(map(len, conn.allowed)) for conn in frames._connections.values()]

    with RawClient(server.server.frames_addresses[0]) as raw:
        raw.hello((("authorization", f"Bearer {ENGINE_A}"),))
        for _ in range(2):
            reply, _ = raw.call(usage, body)
            assert reply.code == 0
            raw.send(frame(padded, body))
            reply, data = raw.read()
            assert reply.code == 0
            assert kvcache_pb2.GetUsageResponse.FromString(data).pool == POOL
        assert server.run(kept) == [[len(call_header(usage))]]


def test_refusals_from_new_connections_of_one_host_are_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The security log is rate-limited per code and peer host, as for gRPC: each framed
    connection comes from a new port, and keying by it would let a flood of connections
    write a line each. A fresh server, so no earlier test's line holds the interval."""
    with short_dir() as tmp:
        (tmp / "engine").write_text(f"{ENGINE_A}\n")
        with frames_server(
            "127.0.0.1:0", ready=False, engine_token_file=str(tmp / "engine")
        ) as fresh:
            caplog.set_level("WARNING", logger="kvsvc.security")
            for _ in range(5):
                with RawClient(f"127.0.0.1:{fresh.server.frames_port}") as raw:
                    assert raw.hello().code == UNAUTHENTICATED
    refused = [r for r in caplog.records if "auth refused" in r.getMessage()]
    assert len(refused) == 1, [r.getMessage() for r in refused]
    assert "from 127.0.0.1:" in refused[0].getMessage()


def test_a_bad_magic_flood_from_one_host_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Connections that do not speak the protocol (a gRPC client, a port scanner) are
    closed with one rate-limited line per host: keyed by the peer's port, a flood of
    connections wrote a line each."""
    with frames_server("127.0.0.1:0", ready=False) as fresh:
        caplog.set_level("WARNING", logger="kvsvc.security")
        for _ in range(5):
            with RawClient(f"127.0.0.1:{fresh.server.frames_port}") as raw:
                raw.send(b"PRI * HTTP/2.0\r\n")
                assert raw.closed_by_server()
    lines = [r.getMessage() for r in caplog.records if "connected from" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0] == "frames: a gRPC (HTTP/2) client connected from 127.0.0.1; closed"
