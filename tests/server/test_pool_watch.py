"""Pool.watch_plan must not miss a change made while its consumer holds the last snapshot.

A plan stream's generator is suspended at ``yield`` while gRPC writes the message; the
plan can be made right then (the last rank registers). Found by a demo run where rank 0
never received its plan.
"""

from __future__ import annotations

import asyncio

from kvsvc.server.config import PoolConfig
from kvsvc.server.pool import Pool, PoolState
from kvsvc.server.registration import MemoryReport, Registration
from tests.server.harness import llama_like_specs

BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16


def registration(rank: int) -> Registration:
    return Registration(
        rank=rank,
        world_size=2,
        device="cpu",
        hostname="test",
        specs=llama_like_specs(),
        memory=MemoryReport(kv_cache_bytes=20 * BYTES_PER_BLOCK),
    )


def test_a_plan_made_while_the_stream_is_suspended_is_delivered() -> None:
    async def scenario() -> PoolState:
        pool = Pool(PoolConfig(name="p", world_size=2, max_model_len=64))
        slot = await pool.register(registration(0))
        stream = pool.watch_plan(0, slot.session_id)
        first = await stream.__anext__()  # the generator now waits in ``yield``
        assert first.state == PoolState.WAITING_FOR_WORKERS
        await pool.register(registration(1))  # plans the pool meanwhile
        second = await asyncio.wait_for(stream.__anext__(), timeout=5)
        assert second.config is not None
        await stream.aclose()
        return second.state

    assert asyncio.run(scenario()) == PoolState.PLANNED
