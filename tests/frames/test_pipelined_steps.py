"""``send_future`` on a framed client without a thread (``step_sender="inline"``): the
Step's frame is written before ``send_future`` returns and its reply read when asked for.
Against a real in-process server: the order Steps are applied in, the one connection they
share, ``then`` on the reading thread, a failed Step, a late reply retried with its call
id (applied once), ``close()`` with a Step in flight, and which options choose which
sender."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kvsvc_client import (
    ClientOptions,
    KVCacheClient,
    NotFoundError,
    PipelinedStep,
    StepFuture,
)
from kvsvc_client._frames import FrameChannel

from tests.frames.helpers import POOL, live_requests, unix_target
from tests.server.harness import ServerThread

INLINE = ClientOptions(step_sender="inline")


def counting_connects(kv: KVCacheClient) -> list[int]:
    """Count the connections ``kv``'s framed channel opens from now on."""
    channel = kv._channel
    assert isinstance(channel, FrameChannel)
    opened = [0]
    connect = channel._connect

    def counted(*args: Any) -> Any:
        opened[0] += 1
        return connect(*args)

    channel._connect = counted  # type: ignore[method-assign]
    return opened


def test_inline_steps_are_applied_in_order_on_one_connection_and_checked_by_the_reader(
    target: str,
) -> None:
    """Four Steps sent before any reply is asked for: each ``send_future`` read the one
    before it first (so they share one connection and are applied in order); ``then`` ran
    on the thread that read, once per Step."""
    seen: list[tuple[str, int]] = []

    def note(results: Any) -> int:
        seen.append((threading.current_thread().name, results[0].num_computed_tokens))
        return int(results[0].num_computed_tokens)

    with KVCacheClient(target, pool=POOL, options=INLINE) as kv:
        assert kv.usage().pool == POOL  # the connection exists before counting
        opened = counting_connects(kv)
        admit = kv.step()
        admit.allocate("in", list(range(11000, 11020)), 20, start=True)
        futures = [admit.send_future(then=note)]
        assert isinstance(futures[0], PipelinedStep)
        for token in (1, 2, 3):
            grow = kv.step()
            grow.allocate("in", [token], 1)
            futures.append(grow.send_future(then=note))
            assert futures[-2].done(), "the Step before was read before this one was sent"
        assert not futures[-1].done()
        assert [future.then_result() for future in futures] == [20, 21, 22, 23]
        assert seen == [(threading.current_thread().name, n) for n in (20, 21, 22, 23)]
        assert [future.result()[0].num_computed_tokens for future in futures] == [20, 21, 22, 23]
        assert opened == [0], "the Steps used the one idle connection"
        assert kv.block_table("in").num_tokens == 23
        kv.free("in")


def test_a_failing_check_and_a_refused_step_raise_from_their_futures(target: str) -> None:
    """``then`` raising: ``then_result()`` raises it, ``result()`` still gives the results.
    A Step the server refuses (its pool unknown): both raise its error and ``then`` never
    runs; the other client goes on with its next Step."""
    calls: list[int] = []

    def broken(results: Any) -> None:
        calls.append(len(results))
        raise ValueError(f"checked {len(results)}")

    with KVCacheClient(target, pool=POOL, options=INLINE) as kv:
        admit = kv.step()
        admit.allocate("bad", list(range(1, 21)), 20, start=True)
        checked = admit.send_future(then=broken)
        assert checked.result()[0].ok
        with pytest.raises(ValueError, match="checked 1"):
            checked.then_result()
        with KVCacheClient(target, pool="no-such-pool", options=INLINE) as elsewhere:
            refused = elsewhere.step()
            refused.allocate("bad", [21], 1)
            failed = refused.send_future(then=broken)
            with pytest.raises(NotFoundError, match="no-such-pool"):
                failed.result()
            with pytest.raises(NotFoundError):
                failed.then_result()
        assert calls == [1]
        grow = kv.step()
        grow.allocate("bad", [21], 1)
        assert grow.send_future().result()[0].num_computed_tokens == 21
        kv.free("bad")


def test_a_late_reply_is_retried_with_its_call_id_and_applied_once(server: ServerThread) -> None:
    """The server's loop is held past the Step's deadline after the frame went out: the
    reader's attempt times out, the retry (same call id, a new connection) is answered
    once the loop runs, and the token is counted once."""
    options = ClientOptions(
        timeout=0.3, retries=10, backoff=0.05, max_backoff=0.1, step_sender="inline"
    )
    with KVCacheClient(unix_target(server), pool=POOL, options=options) as kv:
        assert kv.allocate("late", list(range(1, 21)), 20, start=True).ok
        try:
            server.loop.call_soon_threadsafe(time.sleep, 1.0)
            time.sleep(0.05)
            grow = kv.step()
            grow.allocate("late", [21], 1)
            future = grow.send_future()
            (grown,) = future.result()
            assert grown.ok and grown.num_computed_tokens == 21, grown
            assert kv.block_table("late").num_tokens == 21
        finally:
            kv.free("late")


def test_a_step_sent_and_waited_for_reads_the_pipelined_one_first(target: str) -> None:
    """``send()`` after ``send_future()``: the pipelined Step is read (applied) before the
    waited-for one goes out, whatever connection each takes."""
    with KVCacheClient(target, pool=POOL, options=INLINE) as kv:
        admit = kv.step()
        admit.allocate("mixed", list(range(1, 21)), 20, start=True)
        admitted = admit.send_future()
        grow = kv.step()
        grow.allocate("mixed", [21], 1)
        (grown,) = grow.send()
        assert admitted.done(), "the pipelined Step was read before the next one was sent"
        assert grown.ok and grown.num_computed_tokens == 21, grown
        kv.free("mixed")


def test_close_reads_a_step_still_in_flight(server: ServerThread) -> None:
    """A Step sent and never read is applied and its reply read by ``close()``, as the
    sender thread sends what was queued before it ends."""
    with KVCacheClient(unix_target(server), pool=POOL, options=INLINE) as kv:
        admit = kv.step()
        admit.allocate("closing", list(range(1, 21)), 20, start=True)
        future = admit.send_future()
    assert future.done() and future.result()[0].ok
    assert live_requests(server) == ["closing"]
    with KVCacheClient(unix_target(server), pool=POOL) as kv:
        kv.free("closing")


def test_step_sender_chooses_the_thread_or_refuses_inline_over_grpc(
    server: ServerThread,
) -> None:
    """By default (``thread``) a framed client's Steps go through its sender thread;
    ``inline`` over gRPC and an unknown value are refused, naming the setting."""
    with KVCacheClient(unix_target(server), pool=POOL) as kv:
        step = kv.step()
        step.allocate("threaded", list(range(1, 21)), 20, start=True)
        future = step.send_future()
        assert isinstance(future, StepFuture)
        assert future.result()[0].ok
        kv.free("threaded")
    with pytest.raises(ValueError, match="step_sender='inline' needs a framed target"):
        KVCacheClient(server.address, pool=POOL, options=ClientOptions(step_sender="inline"))
    with pytest.raises(ValueError, match="step_sender must be one of thread, inline"):
        ClientOptions(step_sender="eager")
