"""The asyncio client (``AsyncKVCacheClient``) over the framed transport.

Its channel (``AioFrameChannel``) answers the generated ``grpc.aio`` stubs as gRPC's does:
awaiting a call gives the response, ``trailing_metadata()`` the epoch, and a failure is a
``grpc.aio.AioRpcError`` the client maps to its typed errors. Real in-process servers,
real sockets; over Unix and TCP frames.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from kvsvc_client import (
    AsyncKVCacheClient,
    InvalidArgumentError,
    KVCacheClient,
    KVCacheError,
    NotFoundError,
    UnavailableError,
)

from tests.frames.helpers import (
    POOL,
    QUICK,
    short_dir,
    unix_target,
)
from tests.server.harness import ServerThread


def test_the_engine_sequence_over_asyncio_frames_matches_grpc(
    server: ServerThread, target: str
) -> None:
    """Allocate, a Step, lookup, block_table, usage and free from asyncio over frames; the
    blocks are the ones a gRPC client sees, and the epoch comes with every reply."""
    prompt = list(range(1, 41))

    async def engine() -> tuple[tuple[int, ...], str | None, int]:
        async with AsyncKVCacheClient(target, pool=POOL, options=QUICK) as kv:
            first = await kv.allocate("a", prompt, 40, start=True)
            assert first.ok and first.num_computed_tokens == 40
            step = kv.step()
            step.allocate("a", [41], 1)
            step.allocate("b", prompt, 40, start=True)
            results = await step.send()
            assert len(results) == 2 and all(r.ok for r in results)  # type: ignore[union-attr]
            assert await kv.lookup(prompt) == 32  # two full blocks of 16
            table = await kv.block_table("a")
            usage = await kv.usage()
            assert usage.num_requests == 2
            assert await kv.free("a", "b") >= 0
            return table.groups[0], kv.epoch, (await kv.usage()).num_requests

    with KVCacheClient(server.address, pool=POOL) as over_grpc:
        epoch_before = over_grpc.usage() and over_grpc.epoch
        blocks, epoch, left = asyncio.run(engine())
        assert epoch == epoch_before
        assert left == 0
        assert len(blocks) == 3  # 41 tokens in blocks of 16


def test_errors_are_typed_and_change_nothing(server: ServerThread, target: str) -> None:
    """A bad request and an unknown pool answer the same typed errors as over gRPC; the
    connection goes on serving."""

    async def calls() -> None:
        async with AsyncKVCacheClient(target, pool=POOL, options=QUICK) as kv:
            with pytest.raises(InvalidArgumentError, match="request_id"):
                await kv.allocate("", [1], 1, start=True)
            with pytest.raises(InvalidArgumentError, match="new_token_ids"):
                await kv.allocate("x", [2**31], 1, start=True)
            assert (await kv.usage()).num_requests == 0
        async with AsyncKVCacheClient(target, pool="nope", options=QUICK) as other:
            with pytest.raises(NotFoundError, match="nope"):
                await other.usage()

    asyncio.run(calls())


def test_watch_events_is_unimplemented_over_asyncio_frames(server: ServerThread) -> None:
    async def watch() -> None:
        async with AsyncKVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv:
            async for _ in kv.watch_events():
                pass

    with pytest.raises(KVCacheError, match="served over gRPC only") as caught:
        asyncio.run(watch())
    assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_a_passed_deadline_closes_the_connection_and_the_next_call_is_served(
    server: ServerThread,
) -> None:
    """The server's loop is held for 1 s: a 0.2 s call fails with DEADLINE_EXCEEDED
    (UnavailableError) at its deadline, not after the hold; the next call is served on a
    new connection (the late reply never reaches it)."""

    async def calls() -> float:
        async with AsyncKVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv:
            await kv.usage()  # a connection is open and idle
            server.loop.call_soon_threadsafe(time.sleep, 1.0)
            started = time.monotonic()
            with pytest.raises(UnavailableError) as caught:
                await kv.usage(timeout=0.2)
            took = time.monotonic() - started
            assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await kv.usage()).pool == POOL
            return took

    assert asyncio.run(calls()) < 0.9


def test_no_server_is_unavailable_naming_the_address() -> None:
    async def call(target: str) -> None:
        async with AsyncKVCacheClient(target, pool=POOL, options=QUICK) as kv:
            await kv.usage()

    with short_dir() as tmp, pytest.raises(UnavailableError, match=r"missing\.sock"):
        asyncio.run(call(f"frames:unix:{tmp}/missing.sock"))
