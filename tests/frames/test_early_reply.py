"""A framed engine call is answered as soon as the core applied it, before the events'
drain and the reply's keeping (kvsvc.server.reply_early), unless the pool journals its
changes. Against a real in-process server, with the drain made to fail once: the reply
that went out early is the only one the caller gets (the fault is logged, not sent as a
second reply that would answer the next call), a retry of its call id is answered from
the reply kept; with persistence the reply waits, so the fault is the caller's answer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
from kvsvc_client import KVCacheClient, UnavailableError, _wire
from kvsvc_client.errors import KVCacheError

from tests.frames.helpers import POOL, QUICK, frames_server, live_requests, short_dir, unix_target
from tests.server.harness import ServerThread


@contextmanager
def failing_drain(server: ServerThread) -> Iterator[list[int]]:
    """The pool's next drain of events raises (once); yields how many drains failed."""
    pool = server.server.pools.by_name[POOL]
    drain = pool.drain_events
    failed = [0]

    def once() -> Any:
        if not failed[0]:
            failed[0] += 1
            drain()  # the events still go where they go; the fault is the call's
            raise RuntimeError("injected: the events' drain failed")
        return drain()

    pool.drain_events = once  # type: ignore[method-assign]
    try:
        yield failed
        # The reply can reach this thread before the server's loop gets to the drain (the
        # point of an early reply): what the loop runs next runs after it.
        server.run(lambda: None)
    finally:
        pool.drain_events = drain  # type: ignore[method-assign]


def test_an_early_reply_is_the_only_answer_and_is_kept_for_its_retry() -> None:
    """Without persistence: the drain fails after the OK reply went out; the caller has its
    OK, the connection's next calls their own answers, and a retried call id its reply."""
    with short_dir() as tmp, frames_server(f"unix:{tmp}/s.sock") as server:
        with KVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv:
            with failing_drain(server) as failed:
                result = kv.allocate("early", list(range(1, 21)), 20, start=True)
            assert failed == [1]
            assert result.ok and result.num_computed_tokens == 20, result
            # The next call on the connection gets its own answer, not a stale error frame.
            assert kv.usage().num_requests == 1
            assert kv.block_table("early").num_tokens == 20
            # A retry of a call id answers the reply kept (the bytes that went out early).
            request = kv._stub.Allocate  # the raw stub: the same call id twice
            message = _wire.allocate_request(POOL, "early", [21], 1, 0, False)
            message.call_id = "early-retry-1"
            first = request(message, timeout=5)
            again = request(message, timeout=5)
            assert first == again and first.num_computed_tokens == 21
            assert kv.block_table("early").num_tokens == 21, "the retry applied nothing"
            kv.free("early")
        assert live_requests(server) == []


def test_a_journaled_change_is_answered_only_once_durable() -> None:
    """With persistence the reply waits for the journal: the drain's fault is the answer."""
    with (
        short_dir() as tmp,
        frames_server(f"unix:{tmp}/s.sock", state_dir=str(tmp / "state")) as server,
        KVCacheClient(unix_target(server), pool=POOL, options=QUICK) as kv,
    ):
        with failing_drain(server) as failed, pytest.raises(KVCacheError) as caught:
            kv.allocate("journaled", list(range(1, 21)), 20, start=True)
        assert failed == [1]
        assert not isinstance(caught.value, UnavailableError)
        assert caught.value.code == grpc.StatusCode.INTERNAL, caught.value
        assert kv.usage().pool == POOL
