"""WatchEvents: replay from a sequence, gap markers, and the client resuming across a
server restart."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from queue import Empty, Queue

from kvsvc_client import BlockStored, EventBatch, KVCacheClient

from kvsvc.server.config import PoolConfig
from tests.server.harness import bring_up, running_server

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
