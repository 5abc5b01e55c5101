"""Who may hold a framed connection, and for how long: a bad credential is refused at the
hello, silent and half-sent connections are closed within their bounds, and none of them
keeps a real engine out (frames_max_connections, frames_max_pending_connections and the
frames_*_timeout_s settings, scaled down here)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from kvsvc_client import AsyncKVCacheClient, ClientOptions, KVCacheClient, ResourceExhaustedError

from kvsvc.v1 import kvcache_pb2
from kvsvc.v1.admin_pb2 import GetPlanRequest
from kvsvc.wire.frames import MAGIC, PREFIX, call_header, frame
from tests.frames.helpers import ADMIN as ADMIN_PATH
from tests.frames.helpers import KVCACHE, POOL, RawClient, short_dir, token_server, unix_target
from tests.server.harness import ServerThread

ENGINE = "engine-token-0123456789abc"
AGENT = "agent-token-0123456789abc"
ADMIN = "admin-token-0123456789abc"
UNAUTHENTICATED = 16
RESOURCE_EXHAUSTED = 8
PERMISSION_DENIED = 7
MAX_CONNECTIONS = 3
MAX_PENDING = 2
HELLO_TIMEOUT_S = 0.6
IDLE_TIMEOUT_S = 1.2
FRAME_TIMEOUT_S = 0.6
# The sweep runs every quarter of the shortest bound; a loaded 2-core machine adds more.
SLACK_S = 1.5


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with (
        short_dir() as tmp,
        token_server(
            "unix:{tmp}/l.sock",
            tmp,
            {"engine": f"{ENGINE}\n", "agent": f"{AGENT}\n", "admin": f"{ADMIN}\n"},
            frames_max_connections=MAX_CONNECTIONS,
            frames_max_pending_connections=MAX_PENDING,
            frames_hello_timeout_s=HELLO_TIMEOUT_S,
            frames_idle_timeout_s=IDLE_TIMEOUT_S,
            frames_frame_timeout_s=FRAME_TIMEOUT_S,
        ) as srv,
    ):
        yield srv


def engine(server: ServerThread) -> KVCacheClient:
    options = ClientOptions(token=ENGINE, retries=0, timeout=5, unavailable_timeout=0.0)
    return KVCacheClient(unix_target(server), pool=POOL, options=options)


def address(server: ServerThread) -> str:
    return server.server.frames_addresses[0]


def seconds_until_closed(raw: RawClient) -> float:
    """Block until the server closes ``raw``; how long that took."""
    started = time.monotonic()
    assert raw.closed_by_server()
    return time.monotonic() - started


def usage_body() -> bytes:
    return kvcache_pb2.GetUsageRequest(pool=POOL).SerializeToString()


def test_bad_credentials_take_no_slot_and_the_engine_is_served(server: ServerThread) -> None:
    """More bad-token hellos than there are slots: each is refused and closed at once, and
    an engine that connects afterwards is served."""
    for _ in range(MAX_CONNECTIONS + MAX_PENDING + 3):
        with RawClient(address(server)) as raw:
            answer = raw.hello((("authorization", "Bearer wrong-token-0123456789"),))
            assert answer.code == UNAUTHENTICATED and answer.close
            assert raw.closed_by_server()
    with engine(server) as kv:
        assert kv.usage().pool == POOL


def test_agent_tokens_take_no_slot_and_the_engine_is_served(server: ServerThread) -> None:
    """An agent's token may make no framed call (the Worker service is gRPC's): its hello is
    refused PERMISSION_DENIED and closed, so agents' tokens cannot fill the engines' slots."""
    held = []
    try:
        for _ in range(MAX_CONNECTIONS + 2):
            raw = RawClient(address(server))
            held.append(raw)
            answer = raw.hello((("authorization", f"Bearer {AGENT}"),))
            assert answer.code == PERMISSION_DENIED and answer.close, answer
            assert "agent" in answer.details and AGENT not in answer.details
            assert raw.closed_by_server()
        with engine(server) as kv:
            assert kv.usage().pool == POOL
    finally:
        for raw in held:
            raw.close()


def test_silent_connections_do_not_lock_out_an_engine(server: ServerThread) -> None:
    """Connections that never say hello are pending: past frames_max_pending_connections
    the oldest go at once, the rest within frames_hello_timeout_s; meanwhile a new engine
    connection (its hello comes at once) is served."""
    silent = [RawClient(address(server)) for _ in range(MAX_PENDING + 4)]
    try:
        time.sleep(0.1)  # all accepted: the oldest pushed out by the newest
        with engine(server) as kv:
            assert kv.usage().pool == POOL
        started = time.monotonic()
        for raw in silent:
            assert raw.closed_by_server()
        assert time.monotonic() - started < HELLO_TIMEOUT_S + SLACK_S
    finally:
        for raw in silent:
            raw.close()


def test_a_stalled_hello_is_closed_within_the_hello_timeout(server: ServerThread) -> None:
    with RawClient(address(server)) as raw:
        raw.send(MAGIC + PREFIX.pack(40, 0)[:5])  # half the hello's prefix, then nothing
        elapsed = seconds_until_closed(raw)
    assert HELLO_TIMEOUT_S * 0.9 <= elapsed < HELLO_TIMEOUT_S + SLACK_S


def test_idle_and_half_frame_connections_are_closed_within_their_bounds(
    server: ServerThread,
) -> None:
    """Authenticated connections hold a slot only while they are used: an idle one is
    closed after frames_idle_timeout_s, one that left a frame half sent after
    frames_frame_timeout_s; an engine that was already connected is served throughout."""
    with engine(server) as kv:
        assert kv.usage().pool == POOL  # the engine holds one slot
        idle, half = RawClient(address(server)), RawClient(address(server))
        try:
            _fill_slots_and_stall(server, idle, half)
        finally:
            idle.close()
            half.close()
        assert kv.usage().pool == POOL


def _fill_slots_and_stall(server: ServerThread, idle: RawClient, half: RawClient) -> None:
    for raw in (idle, half):
        assert raw.hello((("authorization", f"Bearer {ENGINE}"),)).code == 0
    # All slots taken: the next one is refused in its hello, naming the bound.
    with RawClient(address(server)) as extra:
        answer = extra.hello((("authorization", f"Bearer {ENGINE}"),))
        assert answer.code == RESOURCE_EXHAUSTED and "frames_max_connections" in answer.details
    assert idle.call(KVCACHE + "GetUsage", usage_body())[0].code == 0
    header = call_header(KVCACHE + "GetUsage")
    half.send(PREFIX.pack(len(header), 100) + header + b"\x0a")  # 1 of 100 body bytes
    elapsed = seconds_until_closed(half)
    assert FRAME_TIMEOUT_S * 0.9 <= elapsed < FRAME_TIMEOUT_S + SLACK_S
    elapsed = seconds_until_closed(idle)
    assert elapsed < IDLE_TIMEOUT_S + SLACK_S


def test_a_client_whose_idle_connection_was_closed_reconnects(server: ServerThread) -> None:
    """kvsvc's clients (sync and asyncio) notice an idle connection the server closed and
    open a new one: the call after a pause longer than frames_idle_timeout_s succeeds,
    without a retry."""
    with engine(server) as kv:
        assert kv.usage().pool == POOL
        time.sleep(IDLE_TIMEOUT_S + SLACK_S)
        assert kv.usage().pool == POOL

    async def pause_between_calls() -> None:
        options = ClientOptions(token=ENGINE, retries=0, timeout=5, unavailable_timeout=0.0)
        async with AsyncKVCacheClient(unix_target(server), pool=POOL, options=options) as kv:
            assert (await kv.usage()).pool == POOL
            await asyncio.sleep(IDLE_TIMEOUT_S + SLACK_S)
            assert (await kv.usage()).pool == POOL

    asyncio.run(pause_between_calls())


def _read_to_the_end(raw: RawClient, timeout: float) -> bool:
    """Read what the server sent until it closes the connection (True) or ``timeout``
    passes without a byte (False)."""
    raw.sock.settimeout(timeout)
    try:
        while raw.sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_connections_that_never_read_their_replies_are_closed(server: ServerThread) -> None:
    """Clients that pipeline calls and never read the replies: once the replies they left
    fill the socket and the server's high-water mark, each connection waits for its client
    to read, which the sweep bounds by frames_frame_timeout_s. Before, a connection stuck
    there kept its slot for ever, and with all slots held a new engine got
    RESOURCE_EXHAUSTED."""
    plan = ADMIN_PATH + "GetPlan"  # ~2 KiB replies: a few hundred fill the buffers
    body = GetPlanRequest(pool=POOL).SerializeToString()
    calls = frame(call_header(plan), body) * 1500
    stuck: list[RawClient] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            raw = RawClient(address(server))
            stuck.append(raw)
            assert raw.hello((("authorization", f"Bearer {ADMIN}"),)).code == 0
            raw.send(calls)
        deadline = time.monotonic() + FRAME_TIMEOUT_S + 4 * SLACK_S
        while True:
            try:
                with engine(server) as kv:
                    assert kv.usage().pool == POOL
                break
            except ResourceExhaustedError:
                assert time.monotonic() < deadline, "the stuck connections kept every slot"
                time.sleep(0.1)
        for raw in stuck:
            assert _read_to_the_end(raw, SLACK_S), "a connection stuck on its replies stayed"
    finally:
        for raw in stuck:
            raw.close()
