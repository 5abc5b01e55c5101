"""What a person at a Python prompt sees of the client: results that print as what they
hold, and a ``watch_events`` loop that can be stopped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from kvsvc_client import (
    AllocateResult,
    FreeResult,
    HashingContext,
    KVCacheClient,
    RequestStart,
    StepResultList,
)
from kvsvc_client._wire import StepBuilder
from kvsvc_client.sync import SyncStep

from kvsvc.server.config import PoolConfig
from tests.server.harness import ServerThread, bring_up, running_server

POOL = "p"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(PoolConfig(name=POOL, world_size=1, max_model_len=1024)) as srv:
        ranks = bring_up(srv, pool=POOL, kv_cache_bytes=4 << 20)
        yield srv
        for rank in ranks:
            rank.close()


def test_step_results_print_their_results(server: ServerThread) -> None:
    with KVCacheClient(server.address, pool=POOL) as kv:
        assert repr(kv) == f"KVCacheClient({server.address!r}, pool='p')"
        step = kv.step()
        step.allocate("r1", list(range(40)), 40, start=True)
        step.free("nobody")
        assert repr(step) == "SyncStep(pool='p', [allocate 'r1', free 'nobody'])"
        results = step.send()
        assert isinstance(results, StepResultList)
        text = repr(results)
        assert "object at 0x" not in text
        assert text.startswith("StepResultList([AllocateResult(status=<AllocateStatus.OK")
        assert f"num_scheduled_tokens=40, num_computed_tokens=40), {results[1]!r}]" in text
        assert text.endswith(f"num_free_blocks={results.num_free_blocks})")
        assert isinstance(results[0], AllocateResult)
        kv.free("r1")


def test_long_reprs_stay_one_readable_line() -> None:
    step = StepBuilder("p")
    for i in range(20):
        step.allocate(f"r{i}", [1], 1)
    step.lookup([1, 2, 3])
    assert repr(step) == (
        "StepBuilder(pool='p', [allocate 'r0', allocate 'r1', allocate 'r2', allocate 'r3', "
        "allocate 'r4', allocate 'r5', allocate 'r6', allocate 'r7', ... 13 more])"
    )
    lookup_only = StepBuilder("p").lookup([1, 2, 3])
    assert repr(lookup_only) == "StepBuilder(pool='p', [lookup 3 tokens])"
    assert issubclass(SyncStep, StepBuilder)


def test_many_results_are_cut_after_eight(server: ServerThread) -> None:
    with KVCacheClient(server.address, pool=POOL) as kv:
        step = kv.step()
        for i in range(12):
            step.allocate(f"m{i}", [i] * 20, 20, start=True)
        results = step.send()
        text = repr(results)
        assert text.count("AllocateResult(") == 8
        assert ", ... 4 more], num_free_blocks=" in text
        release = kv.step()
        for i in range(12):
            release.free(f"m{i}")
        assert all(isinstance(r, FreeResult) for r in release.send())


def test_the_salt_is_part_of_a_lookup(server: ServerThread) -> None:
    # README's client example: a lookup without the admission's salt finds nothing.
    prompt = [*range(100, 164), 1]
    salted = HashingContext(cache_salt="tenant-a")
    with KVCacheClient(server.address, pool=POOL) as kv:
        kv.allocate("s1", prompt, 80, start=RequestStart(hashing=salted))
        assert kv.lookup(prompt, salted) == 64
        assert kv.lookup(prompt) == 0
        kv.free("s1")


def test_close_from_another_thread_ends_watch_events(server: ServerThread) -> None:
    kv = KVCacheClient(server.address, pool=POOL)
    seen: list[int] = []
    ended = threading.Event()

    def follow() -> None:
        for batch in kv.watch_events():  # only new batches: none come, it blocks
            seen.append(batch.sequence)
        ended.set()  # ended without raising

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert not ended.is_set()  # blocked, waiting for the next batch
    kv.close()
    assert ended.wait(10), "watch_events did not end when the client was closed"
    assert seen == []


def test_close_ends_watch_events_on_a_shared_channel(server: ServerThread) -> None:
    channel = grpc.insecure_channel(server.address)
    kv = KVCacheClient(server.address, pool=POOL, channel=channel)
    ended = threading.Event()

    def follow() -> None:
        for _ in kv.watch_events():
            pass
        ended.set()

    threading.Thread(target=follow, daemon=True).start()
    time.sleep(0.5)
    kv.close()  # the channel is the caller's and stays open: the stream is cancelled
    assert ended.wait(10)
    channel.close()


def test_break_ends_the_stream(server: ServerThread) -> None:
    with KVCacheClient(server.address, pool=POOL) as kv:
        kv.allocate("b1", [*range(32), 1], 40, start=True)
        kv.free("b1")
        for batch in kv.watch_events(from_sequence=1):
            assert batch.sequence >= 1
            break
        assert kv._watches == set()  # the stream was cancelled and forgotten
