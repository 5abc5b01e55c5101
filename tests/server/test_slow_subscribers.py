"""WatchEvents subscribers that are slow, stuck or too many never slow the pool.

Measured first (see ``kvsvc.server.events``): each message costs the server ~25 us of gRPC
work per subscriber, so many subscribers behind (64 replaying the buffer) cut a writer's
Steps to a tenth; a subscriber that stops reading blocks its own writes (at no cost per
batch, but holding a slot for ever); a gRPC Python client that never reads keeps
accepting messages into its own memory (to the server it is a fast reader).

The throughput tests run ``kvsvc serve`` as its own process (the writer and the
subscribers are this process) and read the mechanism from ``/metrics``; the others use the
in-process harness and look at the pool's event log directly.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import gc
import logging
import os
import re
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from kvsvc_client import BlockStored, EventBatch, KVCacheClient

from kvsvc.core import AllBlocksCleared, BlockRemoved, KVEventBatch
from kvsvc.core import BlockStored as CoreBlockStored
from kvsvc.demo.processes import Child, spawn, wait_for_ports
from kvsvc.server.config import PoolConfig
from kvsvc.server.events import EventLog
from kvsvc.server.wire import event_batch_to_pb
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.observability.promtext import parse, value
from tests.server.harness import FakeRank, bring_up, llama_like_specs, running_server

BLOCK = 16
PROMPT = 4 * BLOCK  # every admission stores 4 blocks: one BlockStored event
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * BLOCK  # llama_like_specs(): 32 KiB per block
KV_BYTES = 2049 * BYTES_PER_BLOCK  # 2048 usable blocks
# A client that leaves HTTP/2 flow control at its initial 64 KiB window: once that much
# is unread, the server's writes to it block (what a stuck reader looks like to it).
SMALL_WINDOW = (("grpc.http2.bdp_probe", 0),)


class ServeProcess:
    """``kvsvc serve`` in its own process with one READY pool ``p``."""

    def __init__(self, *flags: str) -> None:
        self.child: Child = spawn(
            "server",
            [
                "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--pool", "p", "--max-model-len", "1024", "--log-level", "INFO", *flags,
            ],
        )  # fmt: skip
        try:
            port, self.metrics_port = wait_for_ports(self.child)
            self.address = f"127.0.0.1:{port}"
            self.rank = FakeRank(self.address, "p", 0, 1, llama_like_specs(), KV_BYTES)
            self.rank.register()
            self.rank.open_stream()
            assert not self.rank.wait_for_config().error
            self.rank.report()
        except BaseException:
            self.child.stop()  # a failed bring-up leaves no server behind
            raise

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as reply:
            return value(parse(reply.read().decode()), name, pool="p")

    def wait_for_metric(self, name: str, wanted: float, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name) != wanted:
            assert time.monotonic() < deadline, f"{name} != {wanted}: {self.metric(name)}"
            time.sleep(0.05)

    def close(self) -> None:
        self.rank.close()
        self.child.stop()


@contextlib.contextmanager
def serve(*flags: str) -> Iterator[ServeProcess]:
    server = ServeProcess(*flags)
    try:
        yield server
    finally:
        server.close()


class Writer:
    """An engine whose every Step admits ``per_step`` requests with fresh 64-token prompts
    and frees the previous step's: each Step makes one batch of ``per_step`` stored events
    (and, once the free queue has gone round, removed ones)."""

    def __init__(self, kv: KVCacheClient, per_step: int = 8) -> None:
        self.kv = kv
        self.per_step = per_step
        self.prompts: set[tuple[int, ...]] = set()
        self._live: list[str] = []
        self._n = 0

    def step(self) -> None:
        step = self.kv.step()
        for request_id in self._live:
            step.free(request_id)
        live = []
        for _ in range(self.per_step):
            self._n += 1
            prompt = [(self._n * PROMPT + t) % 1_000_000 + 1 for t in range(PROMPT)]
            self.prompts.add(tuple(prompt))
            live.append(f"w{self._n}")
            step.allocate(live[-1], prompt, PROMPT, start=True)
        assert not step.send().no_space_indices()
        self._live = live

    def run_for(self, seconds: float) -> float:
        """Steps for ``seconds``; returns Steps per second."""
        count = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            self.step()
            count += 1
        return count / elapsed


def watch(stub: kvcache_pb2_grpc.KVCacheServiceStub, from_sequence: int | None = None) -> Any:
    request = kvcache_pb2.WatchEventsRequest(pool="p")
    if from_sequence is not None:
        request.from_sequence = from_sequence
    return stub.WatchEvents(request)


def test_subscribers_that_never_read_cost_the_writer_a_bounded_share() -> None:
    """64 subscribers replaying the buffer, none of them reading: before, the writer kept
    a tenth of its Steps while they were sent (each subscriber's messages went out as fast
    as the loop could send them: the client library keeps accepting them); paced, the
    writer keeps most of the loop."""
    with serve("--max-subscribers", "64") as server, KVCacheClient(server.address, pool="p") as kv:
        writer = Writer(kv)
        writer.run_for(1.0)  # warm-up, and a replay buffer worth replaying
        alone = writer.run_for(2.0)
        channel = grpc.insecure_channel(server.address)
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        calls = [watch(stub, from_sequence=1) for _ in range(64)]
        try:
            server.wait_for_metric("kvsvc_event_subscribers", 64)
            watched = writer.run_for(2.0)
            assert watched >= alone / 3, f"{watched:.0f} Steps/s watched vs {alone:.0f} alone"
        finally:
            for call in calls:
                call.cancel()
            channel.close()
        server.wait_for_metric("kvsvc_event_subscribers", 0)


def test_a_stuck_subscriber_is_cut_and_told_where_to_resume() -> None:
    with (
        serve("--subscriber-write-timeout", "1") as server,
        KVCacheClient(server.address, pool="p") as kv,
        grpc.insecure_channel(server.address, options=SMALL_WINDOW) as channel,
    ):
        writer = Writer(kv)
        stuck = watch(kvcache_pb2_grpc.KVCacheServiceStub(channel), from_sequence=1)
        server.wait_for_metric("kvsvc_event_subscribers", 1)
        deadline = time.monotonic() + 30
        # Unread batches fill its window; then a write blocks, and after 1 s it is cut.
        while server.metric("kvsvc_event_subscribers_cut_total") < 1:
            assert time.monotonic() < deadline, "the stuck subscriber was never cut"
            writer.run_for(0.1)
        assert server.metric("kvsvc_event_subscribers") == 0  # its slot is free
        writer.run_for(0.2)  # the pool goes on, nobody waiting for it
        # Reading at last, it gets what was under way, then the reason and where to resume.
        received = []
        with pytest.raises(grpc.RpcError) as error:
            for message in stuck:
                received.append(message.sequence)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = error.value.details() or ""
        assert "subscriber_write_timeout_s=1" in details, details
        resume = int(re.search(r"from_sequence=(\d+)", details).group(1))  # type: ignore[union-attr]
        assert received == list(range(1, len(received) + 1))
        assert 1 < resume <= received[-1] + 1  # resuming there misses nothing
        first = next(kv.watch_events(from_sequence=resume, reconnect=False))
        assert first.sequence == resume and not first.gap
        assert "WatchEvents subscriber" in server.child.output()
        assert "cut: a write did not complete" in server.child.output()


def test_a_slow_subscriber_gets_a_gap_then_consistent_events() -> None:
    with (
        serve("--subscriber-max-lag-bytes", "64KiB") as server,
        KVCacheClient(server.address, pool="p") as kv,
        grpc.insecure_channel(server.address, options=SMALL_WINDOW) as channel,
    ):
        writer = Writer(kv)
        writer.step()
        slow_messages: list[kvcache_pb2.WatchEventsResponse] = []
        fast_batches: dict[int, EventBatch] = {}
        done = threading.Event()
        slow = watch(kvcache_pb2_grpc.KVCacheServiceStub(channel), from_sequence=1)

        def read_slowly() -> None:
            after_gap = 0
            for message in slow:
                slow_messages.append(message)
                after_gap += bool(after_gap or message.gap)
                if after_gap > 30:
                    break
                time.sleep(0.005)  # ~200 messages/s against the writer's ~1000 batches/s
            done.set()

        def read_fast() -> None:
            for batch in kv.watch_events(from_sequence=1):
                fast_batches.setdefault(batch.sequence, batch)
                if done.is_set():
                    return

        threads = [threading.Thread(target=f, daemon=True) for f in (read_slowly, read_fast)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while not done.is_set():
            assert time.monotonic() < deadline, "the slow subscriber never got a gap"
            writer.run_for(0.05)
        slow.cancel()
        writer.step()  # wakes the fast reader so it sees that we are done
        threads[1].join(10)
        assert server.metric("kvsvc_event_subscribers_lagged_total") >= 1

    gaps = [i for i, m in enumerate(slow_messages) if m.gap]
    assert gaps and gaps[0] > 0, "the gap came mid-stream, after batches it did read"
    before, gap, after = (
        slow_messages[: gaps[0]],
        slow_messages[gaps[0]],
        slow_messages[gaps[0] + 1 :],
    )
    assert [m.sequence for m in before] == list(range(1, len(before) + 1))
    assert gap.oldest_available_sequence > before[-1].sequence + 1  # it skipped ahead
    # From the resume point on (up to a later gap, if any), consecutive batches.
    run = after[: (gaps[1] - gaps[0] - 1) if len(gaps) > 1 else len(after)]
    sequences = [m.sequence for m in run]
    assert sequences and sequences[0] == gap.oldest_available_sequence
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))
    epochs = {m.epoch for m in slow_messages}
    assert len(epochs) == 1
    compared = 0
    for message in before + after:
        if message.gap:
            continue
        for event in message.events:
            if event.HasField("stored"):
                assert tuple(event.stored.token_ids) in writer.prompts
                assert len(event.stored.block_hashes) == PROMPT // BLOCK
        reference = fast_batches.get(message.sequence)
        if reference is not None:
            compared += 1
            stored = [tuple(e.stored.token_ids) for e in message.events if e.HasField("stored")]
            assert stored == [e.token_ids for e in reference.events if isinstance(e, BlockStored)]
    assert compared > 0


def test_the_cap_refuses_one_more_subscriber_and_frees_the_slot_when_one_leaves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvsvc.security")
    pool = PoolConfig(name="p", world_size=1, max_model_len=256, max_subscribers=2)
    with running_server(pool) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=41 * BYTES_PER_BLOCK)
        log = server.server.pools.get("p").events

        def subscribers() -> int:
            return int(server.run(lambda: log.num_subscribers))

        def wait_for(count: int) -> None:
            deadline = time.monotonic() + 10
            while subscribers() != count:
                assert time.monotonic() < deadline, f"{subscribers()} subscribers, not {count}"
                time.sleep(0.02)

        with grpc.insecure_channel(server.address) as channel:
            stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
            first, second = watch(stub), watch(stub)
            wait_for(2)
            with pytest.raises(grpc.RpcError) as error:
                next(watch(stub))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_subscribers=2" in (error.value.details() or "")
            assert server.run(lambda: log.num_refused) == 1
            assert any("WatchEvents refused" in r.getMessage() for r in caplog.records)
            first.cancel()
            wait_for(1)
            third = watch(stub)
            wait_for(2)
            with KVCacheClient(server.address, pool="p") as kv:
                kv.allocate("r", list(range(1, 17)), 16, start=True)
            assert next(third).sequence == next(second).sequence == 1
            second.cancel()
            third.cancel()
            wait_for(0)
        for rank in ranks:
            rank.close()


def test_the_replay_buffer_stays_under_its_byte_bound() -> None:
    bound = 64 * 1024
    pool = PoolConfig(name="p", world_size=1, max_model_len=256)
    with running_server(pool, event_buffer_bytes=bound) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        log = server.server.pools.get("p").events
        with KVCacheClient(server.address, pool="p") as kv:
            writer = Writer(kv, per_step=4)
            for _ in range(30):
                for _ in range(10):
                    writer.step()
                assert 0 < server.run(lambda: log.held_bytes) <= bound
            oldest, last, dropped = server.run(
                lambda: (log.oldest_sequence, log.last_sequence, log.num_dropped_batches)
            )
            assert dropped == oldest - 1 > 0
            # A replay serializes what it sends: the held bytes are then its real size.
            stream = kv.watch_events(from_sequence=1, reconnect=False)
            gap = next(stream)
            assert gap.gap and gap.oldest_available_sequence == oldest
            for _ in range(last - oldest + 1):
                next(stream)
            assert 0 < server.run(lambda: log.held_bytes) <= bound
        for rank in ranks:
            rank.close()


def core_like_batch(seq: int, per_batch: int = 8) -> KVEventBatch:
    """A batch as the core makes it: fresh token lists (from an array, as a packed prompt
    is held) and fresh 16-byte hashes."""
    stored: list[Any] = [
        CoreBlockStored(
            [os.urandom(16) for _ in range(4)],
            None,
            array.array("I", range(1000 + i, 1000 + i + PROMPT)).tolist(),
            BLOCK,
            None,
            "GPU",
            0,
            "full_attention",
        )
        for i in range(per_batch)
    ]
    removed = BlockRemoved([os.urandom(16) for _ in range(8)], "GPU", 0)
    return KVEventBatch(seq, time.time(), [*stored, removed])


@pytest.mark.parametrize("packs", [True, False], ids=["packed", "as-objects"])
def test_the_byte_estimate_of_held_batches_is_an_honest_upper_bound(packs: bool) -> None:
    """The bound is only as good as the estimate: it must not undercount the batches'
    real memory (tracemalloc), held packed (or as objects, for events that do not pack)
    before they are serialized, or after."""
    log = EventLog(capacity=10**6, max_events=10**9, max_bytes=10**12)
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for seq in range(1, 501):
            batch = core_like_batch(seq)
            if not packs:  # an extra key marshal does not write: held as objects
                batch.events[0].extra_keys = [(object(),)] * 4  # type: ignore[union-attr]
            log.append(batch)  # the log holds the only reference
        held_bytes = tracemalloc.get_traced_memory()[0] - baseline
        assert held_bytes <= log.held_bytes <= 2 * held_bytes
        for seq in range(1, 501):
            log.message(seq)  # serialized once: only the bytes stay held
        serialized_bytes = tracemalloc.get_traced_memory()[0] - baseline
        assert serialized_bytes <= log.held_bytes <= 2 * serialized_bytes
        # Packed, a batch takes about what its wire bytes take; as objects, 4x more.
        assert log.held_bytes < held_bytes / (1.2 if packs else 4)
    finally:
        tracemalloc.stop()


def test_held_batches_give_the_collector_nothing_to_walk() -> None:
    """A held batch is one object the garbage collector tracks (its entry), not three per
    event (the event, its hash list, its token array): the buffer's 200,000 events were
    most of what the server's collections walked, in pauses of several milliseconds."""
    log = EventLog(capacity=10**6, max_events=10**9, max_bytes=10**12)
    gc.collect()
    before = len(gc.get_objects())
    for seq in range(1, 1001):
        log.append(core_like_batch(seq, per_batch=16))
    gc.collect()
    assert len(gc.get_objects()) - before <= 1000 * 2


def test_a_held_batch_is_served_as_the_batch_it_was() -> None:
    """Every field of every kind of event comes back from the packed form (and from the
    objects a batch that does not pack is held as) as the core made it."""
    events: list[Any] = [
        CoreBlockStored(
            [b"h1", b"h2"],
            b"h0",
            array.array("I", range(1, 33)),
            16,
            "adapter",
            "GPU",
            1,
            "sliding_window",
            [("lora", "adapter", "/path"), None],
            7,
        ),
        CoreBlockStored([], None, [5] * 16, 16, None, "CPU", 0, "full_attention"),
        BlockRemoved([b"h1", b"h9"], "GPU", 1),
        AllBlocksCleared(),
    ]
    expected = event_batch_to_pb(KVEventBatch(1, 12.5, events))
    log = EventLog(capacity=10)
    expected.epoch = log.epoch
    log.append(KVEventBatch(1, 12.5, events))
    assert log.message(1) == expected.SerializeToString()
    # Held as objects when a value does not pack; served the same.
    odd = CoreBlockStored([b"h3"], b"h2", [1] * 16, 16, None, "GPU", 0, "full_attention")
    odd.extra_keys = [(object(),)]
    log.append(KVEventBatch(2, 13.0, [odd]))
    expected = event_batch_to_pb(KVEventBatch(2, 13.0, [odd]))
    expected.epoch = log.epoch
    assert log.message(2) == expected.SerializeToString()


def test_pacing_leaves_the_writer_most_of_the_loop() -> None:
    """The send gate alone, with writes that each burn 100 us of the loop: 64 subscribers
    behind would take all of it unpaced; paced they take at most about a third."""

    async def run() -> float:
        log = EventLog(capacity=10**5, max_events=10**9, max_bytes=10**12, max_subscribers=64)
        busy = 0.0

        async def write(data: bytes) -> None:
            nonlocal busy
            started = time.perf_counter()
            while time.perf_counter() - started < 100e-6:
                pass
            busy += time.perf_counter() - started
            await asyncio.sleep(0)  # the write's completion comes back through the loop

        for seq in range(1, 201):
            log.append(core_like_batch(seq, per_batch=1))
        tasks = [asyncio.create_task(log.serve(write, 1)) for _ in range(64)]
        appends = 0
        started = time.perf_counter()
        while time.perf_counter() - started < 0.5:
            appends += 1
            log.append(core_like_batch(log.last_sequence + 1, per_batch=1))
            await asyncio.sleep(0)
        elapsed = time.perf_counter() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert appends > 100
        return busy / elapsed

    share = asyncio.run(run())
    # With PAUSE_RATIO 2: a third of the loop at most, however many subscribers are behind.
    assert share < 0.5, f"subscribers took {share:.0%} of the loop"
