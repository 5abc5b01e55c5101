"""The request budget (kvsvc.server.transports.budget) on its own: who reads when, and
what is held. Scenarios with exact byte counts; the listeners' use of it is tested
against real servers in tests/server/test_request_memory.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvsvc.server.transports.budget import RequestBudget

MiB = 1 << 20


def run(scenario: Callable[[RequestBudget], Awaitable[Any]], total: int, per_caller: int) -> Any:
    return asyncio.run(scenario(RequestBudget(total, per_caller)))


async def _started(
    budget: RequestBudget, caller: str, size: int, leave: int = 0
) -> asyncio.Task[None]:
    """A reservation that is waiting (or granted) once this returns."""
    task = asyncio.get_running_loop().create_task(budget.reserve(caller, size, leave))
    await asyncio.sleep(0)
    return task


def test_a_caller_reads_and_runs_one_large_message_at_a_time_and_others_go_on() -> None:
    async def scenario(budget: RequestBudget) -> None:
        await budget.reserve("attacker", 64 * MiB)  # its first read
        second = await _started(budget, "attacker", 64 * MiB)
        engine = await _started(budget, "engine", 64 * MiB)
        assert not second.done() and engine.done()  # the engine is not behind it
        assert budget.reading == {"attacker": 64 * MiB, "engine": 64 * MiB}
        assert budget.received("engine", 64 * MiB, 100)  # a small Step: the engine is free
        assert budget.reading == {"attacker": 64 * MiB}
        # The attacker's first is in: a large request, its own until its call ends.
        assert budget.received("attacker", 64 * MiB, 60 * MiB)
        await asyncio.sleep(0)
        assert not second.done() and budget.reading == {"attacker": 60 * MiB}
        budget.release("attacker", 60 * MiB)  # refused, or run: done
        await asyncio.sleep(0)
        assert second.done() and budget.reading == {"attacker": 64 * MiB}
        assert budget.held == 100 and budget.num_waited == 1

    run(scenario, total=256 * MiB, per_caller=64 * MiB)


def test_the_total_is_granted_in_arrival_order() -> None:
    """A reservation that waits for the total is not overtaken by later ones (a stream of
    reads would starve it); one that waits for its own caller's read is passed over."""

    async def scenario(budget: RequestBudget) -> None:
        await budget.reserve("a", 64 * MiB)
        await budget.reserve("b", 64 * MiB)
        own = await _started(budget, "a", 64 * MiB)  # waits for a's first read
        blocked = await _started(budget, "c", 64 * MiB)  # waits for the total
        later = await _started(budget, "d", 1 * MiB)  # would fit, but c came first
        assert not (own.done() or blocked.done() or later.done())
        budget.cancel("b", 64 * MiB)  # b's read failed: room for c, then d
        await asyncio.sleep(0)
        assert blocked.done() and later.done() and not own.done()
        assert budget.reading_total == 64 * MiB + 64 * MiB + 1 * MiB

    run(scenario, total=128 * MiB + 1 * MiB, per_caller=64 * MiB)


def test_large_frames_leave_room_for_a_grpc_read() -> None:
    """Frames' reservations leave one gRPC read's worth: a gRPC message's size is not
    known before it is read, and large frames that took the whole total stopped every
    gRPC call (an engine's Step waited 28 s behind frames left half sent). A frame that
    waits for that room does not hold up a gRPC read behind it."""

    async def scenario(budget: RequestBudget) -> None:
        leave = 64 * MiB
        for conn in range(3):
            assert budget.try_reserve(f"conn{conn}", 60 * MiB, leave)
        frame = await _started(budget, "conn3", 60 * MiB, leave)
        grpc_read = await _started(budget, "engine", 64 * MiB)
        assert not frame.done() and grpc_read.done()
        assert budget.reading_total == 3 * 60 * MiB + 64 * MiB

    run(scenario, total=256 * MiB, per_caller=64 * MiB)


def test_a_request_past_the_held_bound_is_refused_and_holds_nothing() -> None:
    async def scenario(budget: RequestBudget) -> None:
        await budget.reserve("a", 64 * MiB)
        assert budget.received("a", 64 * MiB, 40 * MiB)
        await budget.reserve("b", 64 * MiB)  # reads do not wait for held bytes
        assert not budget.received("b", 64 * MiB, 40 * MiB)  # 80 MiB would pass 64
        assert budget.held == 40 * MiB and budget.num_refused == 1
        await budget.reserve("c", 64 * MiB)
        assert budget.received("c", 64 * MiB, 1 * MiB)  # a small one still fits
        budget.release("a", 40 * MiB)
        budget.release("c", 1 * MiB)
        assert budget.held == 0 and budget.reading_total == 0 and budget.reading == {}

    run(scenario, total=64 * MiB, per_caller=64 * MiB)


def test_a_cancelled_wait_leaves_nothing_reserved_and_lets_the_next_in() -> None:
    async def scenario(budget: RequestBudget) -> None:
        await budget.reserve("a", 64 * MiB)
        gone = await _started(budget, "b", 64 * MiB)  # waits for the total
        next_ = await _started(budget, "c", 64 * MiB)
        gone.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await gone
        budget.cancel("a", 64 * MiB)
        await asyncio.sleep(0)
        assert next_.done() and budget.reading == {"c": 64 * MiB}

    run(scenario, total=64 * MiB, per_caller=64 * MiB)
