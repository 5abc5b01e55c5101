"""WatchEvents: replay from a sequence, gap and caught-up markers, and the client resuming
across a server restart."""

from __future__ import annotations

import contextlib
import threading
import time
from queue import Empty, Queue
from typing import Any

import grpc
from kvsvc_client import BlockStored, EventBatch, KVCacheClient
from kvsvc_client._wire import resume_sequence

from kvsvc.server.config import PoolConfig
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import bring_up, running_server
from tests.tooling import free_port

POOL = PoolConfig(name="p", world_size=1, max_model_len=256)
KV_BYTES = 41 * 4 * 2 * 128 * 2 * 16  # 40 usable blocks of the harness specs


def stored_tokens(batch: EventBatch) -> list[tuple[int, ...]]:
    return [e.token_ids for e in batch.events if isinstance(e, BlockStored)]


def test_a_start_that_was_dropped_gets_a_gap_marker_first() -> None:
    with running_server(POOL, event_buffer_batches=2) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            for i in range(5):  # five batches: one stored block each
                kv.allocate(f"r{i}", [100 * i + t for t in range(16)], 16, start=True)
            stream = kv.watch_events(from_sequence=1)
            gap = next(stream)
            assert gap.gap and gap.oldest_available_sequence == 4
            assert [next(stream).sequence for _ in range(2)] == [4, 5]
        for rank in ranks:
            rank.close()


def test_the_client_resumes_across_a_server_restart() -> None:
    address = f"127.0.0.1:{free_port()}"
    received: Queue[EventBatch] = Queue()
    stop = threading.Event()

    def follow() -> None:
        with KVCacheClient(address, pool="p") as kv:
            for batch in kv.watch_events(from_sequence=1):
                received.put(batch)
                if stop.is_set():
                    return

    def drain(count: int) -> list[EventBatch]:
        out: list[EventBatch] = []
        deadline = time.monotonic() + 20
        while len(out) < count and time.monotonic() < deadline:
            with contextlib.suppress(Empty):
                out.append(received.get(timeout=0.2))
        return out

    with running_server(POOL, listen=address) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        with KVCacheClient(address, pool="p") as kv:
            kv.allocate("a", list(range(16)), 16, start=True)
            first = drain(1)
        assert stored_tokens(first[0]) == [tuple(range(16))]
        for rank in ranks:
            rank.close()
    # The server is gone; a new one comes up on the same address (a new epoch).
    with running_server(POOL, listen=address) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(address, pool="p") as kv:
            kv.allocate("b", list(range(50, 66)), 16, start=True)
            later = drain(2)
            stop.set()
            kv.allocate("c", list(range(80, 96)), 16, start=True)  # wakes the follower
        # Resumed without being asked again: told that numbering restarted, then the
        # new server's events from its first batch on.
        assert later[0].gap
        assert later[0].epoch != first[0].epoch
        assert later[1].sequence == 1
        assert stored_tokens(later[1]) == [tuple(range(50, 66))]
        for rank in ranks:
            rank.close()
        follower.join(10)


def test_the_replay_buffer_is_bounded_by_events_too() -> None:
    with running_server(POOL, event_buffer_batches=100, event_buffer_events=3) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            for i in range(5):  # five batches of one stored event each
                kv.allocate(f"r{i}", [100 * i + t for t in range(16)], 16, start=True)
            stream = kv.watch_events(from_sequence=1)
            gap = next(stream)
            assert gap.gap and gap.oldest_available_sequence == 3
        for rank in ranks:
            rank.close()


def watch_raw(address: str, **fields: Any) -> Any:
    """A raw WatchEvents stream of pool "p" (10 s deadline: a missing message fails, not
    hangs), to see the wire fields as any client gets them."""
    channel = grpc.insecure_channel(address)
    stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
    return stub.WatchEvents(kvcache_pb2.WatchEventsRequest(pool="p", **fields), timeout=10)


def admit(kv: KVCacheClient, count: int, base: int = 0) -> None:
    """``count`` batches of one stored block each."""
    for i in range(count):
        kv.allocate(f"r{base + i}", [100 * (base + i) + t for t in range(16)], 16, start=True)


def test_the_caught_up_marker_comes_once_after_the_replay() -> None:
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            admit(kv, 3)
            stream = watch_raw(server.address, from_sequence=1, send_caught_up=True)
            replay = [next(stream) for _ in range(3)]
            assert [m.sequence for m in replay] == [1, 2, 3]
            assert not any(m.caught_up for m in replay)
            marker = next(stream)
            assert marker.caught_up and not marker.gap and not marker.events
            assert marker.sequence == 0 and marker.oldest_available_sequence == 4
            assert marker.epoch == replay[0].epoch
            admit(kv, 2, base=3)
            live = [next(stream) for _ in range(2)]  # no second marker
            assert [(m.sequence, m.caught_up) for m in live] == [(4, False), (5, False)]
            stream.cancel()
        for rank in ranks:
            rank.close()


def test_without_a_replay_the_caught_up_marker_comes_at_once() -> None:
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            admit(kv, 2)
            for fields in ({}, {"from_sequence": 3}):  # only new ones; the next sequence
                stream = watch_raw(server.address, send_caught_up=True, **fields)
                marker = next(stream)
                assert marker.caught_up and marker.oldest_available_sequence == 3
                stream.cancel()
        for rank in ranks:
            rank.close()


def test_a_gap_then_the_replay_then_caught_up() -> None:
    """The gap marker has sequence 0 too (batches start at 1) and names the next batch."""
    with running_server(POOL, event_buffer_batches=2) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            admit(kv, 5)
            stream = watch_raw(server.address, from_sequence=1, send_caught_up=True)
            messages = [next(stream) for _ in range(4)]
            stream.cancel()
            assert [
                (m.sequence, m.gap, m.caught_up, m.oldest_available_sequence) for m in messages
            ] == [
                (0, True, False, 4),
                (4, False, False, 0),
                (5, False, False, 0),
                (0, False, True, 6),
            ]
        for rank in ranks:
            rank.close()


def test_no_caught_up_marker_unless_asked() -> None:
    """Subscribers built before the marker never see one (they would take it for a batch)."""
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            admit(kv, 2)
            stream = watch_raw(server.address, from_sequence=1)
            assert [next(stream).sequence for _ in range(2)] == [1, 2]
            admit(kv, 1, base=2)
            after = next(stream)
            assert (after.sequence, after.caught_up) == (3, False)
            stream.cancel()
        for rank in ranks:
            rank.close()


def test_the_client_yields_the_marker_and_resumes_where_it_points() -> None:
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            admit(kv, 2)
            stream = kv.watch_events(from_sequence=1, caught_up=True)
            got = [next(stream) for _ in range(3)]
            assert [(b.sequence, b.caught_up) for b in got] == [(1, False), (2, False), (0, True)]
            assert got[2].events == () and got[2].oldest_available_sequence == 3
            stream.close()
        for rank in ranks:
            rank.close()
    # After a marker a reconnect asks for the batch it names, not sequence 1 (0 + 1).
    marker = EventBatch(0, 0.0, (), "e", caught_up=True, oldest_available_sequence=7)
    gap = EventBatch(0, 0.0, (), "e", gap=True, oldest_available_sequence=9)
    assert [resume_sequence(b) for b in (marker, gap, EventBatch(5, 0.0, (), "e"))] == [7, 9, 6]
