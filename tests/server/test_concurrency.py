"""Several engines writing to one pool at once, against a real server on loopback.

* Writers in threads and in processes admit, decode, step and free their own requests
  (with shared prefixes, so blocks are shared and hit) on a pool small enough to run out,
  while readers call GetBlockTable, GetUsage and Lookup; one writer sends Steps big enough
  to run in a worker thread (``OFFLOAD_WORK_THRESHOLD``). Afterwards every live request's
  table is what its writer saw, every block is free or owned (free + held = total, ref
  counts = holders), and freeing everything gives every block back.
* While an offloaded call runs, small writes that arrive wait for it: the pool has one
  writer at a time. The offloaded call is held until a small write has reached the
  server, so the check does not depend on timing.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from kvsvc_client import KVCacheClient, NotFoundError, StepResultList

from kvsvc.server.config import PoolConfig
from kvsvc.server.servicers import OFFLOAD_WORK_THRESHOLD
from tests.core.core_factories import check_pool_invariants
from tests.server.harness import ServerThread, bring_up, llama_like_specs, running_server

BLOCK = 16
NUM_BLOCKS = 160  # the null block included
MAX_MODEL_LEN = 2048
# llama_like_specs(): 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens a block.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * BLOCK
SHARED_PREFIXES = [[1000 + p] * (2 * BLOCK) + list(range(p * 100, p * 100 + 20)) for p in range(3)]
# A Step of this many 2000-token admissions is above the offload threshold.
BIG_PROMPT = 2000
BIG_ADMISSIONS = OFFLOAD_WORK_THRESHOLD // BIG_PROMPT + 2


@pytest.fixture
def server() -> Iterator[ServerThread]:
    pool = PoolConfig(
        name="p",
        world_size=1,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=NUM_BLOCKS,
        # Threads admit big prompts with a small first chunk: their unscheduled tokens
        # are this test's load, not a bound it is about.
        max_unscheduled_tokens=1 << 24,
        max_pool_tokens=1 << 24,
    )
    with running_server(pool) as srv:
        ranks = bring_up(srv, specs=llama_like_specs(), kv_cache_bytes=NUM_BLOCKS * BYTES_PER_BLOCK)
        try:
            yield srv
        finally:
            for rank in ranks:
                rank.close()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class EngineView:
    """What one writer knows of its live requests: tokens and computed tokens."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    no_space: int = 0

    def admitted(self, rid: str, prompt: list[int], computed: int) -> None:
        self.tokens[rid] = list(prompt)
        self.computed[rid] = computed

    def gone(self, rid: str) -> None:
        del self.tokens[rid], self.computed[rid]


def _check_step(
    view: EngineView, ops: list[tuple[str, str, list[int]]], results: StepResultList
) -> None:
    for (kind, rid, tokens), result in zip(ops, results, strict=True):
        if kind == "free":
            view.gone(rid)
            continue
        assert not hasattr(result, "code"), (rid, result)
        if not result.ok:
            view.no_space += 1
            continue
        if kind == "admit":
            assert result.num_cached_tokens % BLOCK == 0
            assert result.num_computed_tokens == len(tokens)
            view.admitted(rid, tokens, len(tokens))
        else:
            view.tokens[rid].extend(tokens)
            view.computed[rid] += 1
            assert result.num_computed_tokens == view.computed[rid]


def run_writer(
    address: str, name: str, seed: int, iterations: int, big_steps: int = 0
) -> tuple[dict[str, tuple[int, int]], int]:
    """One engine's traffic; returns its live requests as ``{rid: (tokens, computed)}``
    and the number of calls it made.

    Module-level so that process writers can run it (spawned interpreters import it).
    """
    rng = random.Random(seed)
    view = EngineView()
    next_id = 0
    with KVCacheClient(address, pool="p") as kv:
        for i in range(iterations):
            live = sorted(view.tokens)
            choice = rng.random()
            if big_steps and i % max(1, iterations // big_steps) == 0:
                # Long prompts with a one-block budget: offloaded by their size, cheap in blocks.
                step = kv.step()
                ops: list[tuple[str, str, list[int]]] = []
                for _ in range(BIG_ADMISSIONS):
                    rid = f"{name}-big{next_id}"
                    next_id += 1
                    prompt = [rng.randrange(50_000) for _ in range(BIG_PROMPT)]
                    step.allocate(rid, prompt, BLOCK, start=True)
                    ops.append(("chunk", rid, prompt))
                results = step.send(timeout=120)
                view.calls += 1
                release = kv.step()
                for (_, rid, _), result in zip(ops, results, strict=True):
                    assert not hasattr(result, "code"), (rid, result)
                    if result.ok:
                        assert result.num_computed_tokens == BLOCK
                        release.free(rid)
                    else:
                        view.no_space += 1
                if len(release):
                    release.send(timeout=60)
            elif len(live) > 8:
                # Keep the pool churning instead of filling it for good.
                rid = rng.choice(live)
                kv.free(rid)
                view.calls += 1
                view.gone(rid)
            elif choice < 0.3 or not live:
                rid = f"{name}-{next_id}"
                next_id += 1
                prompt = rng.choice(SHARED_PREFIXES) + [
                    rng.randrange(50) for _ in range(rng.randrange(1, 60))
                ]
                result = kv.allocate(rid, prompt, len(prompt), start=True)
                view.calls += 1
                if result.ok:
                    assert result.num_cached_tokens % BLOCK == 0
                    assert result.num_cached_tokens <= len(prompt) - 1
                    assert result.num_computed_tokens == len(prompt)
                    view.admitted(rid, prompt, len(prompt))
                else:
                    view.no_space += 1
            elif choice < 0.6:
                rid = rng.choice(live)
                if len(view.tokens[rid]) >= MAX_MODEL_LEN - 1:
                    continue
                token = rng.randrange(50)
                result = kv.allocate(rid, [token], 1)
                view.calls += 1
                if result.ok:
                    view.tokens[rid].append(token)
                    view.computed[rid] += 1
                    assert result.num_computed_tokens == view.computed[rid]
                else:
                    view.no_space += 1
                    kv.free(rid, preempted=True)
                    view.gone(rid)
            elif choice < 0.85:
                # One scheduling step: decode everyone, maybe admit one and finish one.
                step = kv.step()
                ops = []
                for rid in live:
                    token = rng.randrange(50)
                    step.allocate(rid, [token], 1)
                    ops.append(("decode", rid, [token]))
                if rng.random() < 0.5:
                    rid = f"{name}-{next_id}"
                    next_id += 1
                    prompt = rng.choice(SHARED_PREFIXES) + [rng.randrange(50) for _ in range(5)]
                    step.allocate(rid, prompt, len(prompt), start=True)
                    ops.append(("admit", rid, prompt))
                if live and rng.random() < 0.3:
                    # Freed after its decode in the same step.
                    rid = rng.choice(live)
                    step.free(rid)
                    ops.append(("free", rid, []))
                _check_step(view, ops, step.send(timeout=60))
                view.calls += 1
            else:
                rid = rng.choice(live)
                kv.free(rid)
                view.calls += 1
                view.gone(rid)
    return {rid: (len(t), view.computed[rid]) for rid, t in view.tokens.items()}, view.calls


class Readers:
    """Threads calling GetUsage, Lookup and GetBlockTable until stopped, checking each
    answer is a consistent state of the pool."""

    def __init__(self, address: str, names: list[str]) -> None:
        self._address = address
        self._names = names
        self._stop = threading.Event()
        self.reads = 0
        self.tables_seen = 0
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)
        ]
        self.errors: list[BaseException] = []

    def __enter__(self) -> Readers:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, index: int) -> None:
        rng = random.Random(index)
        try:
            with KVCacheClient(self._address, pool="p") as kv:
                while not self._stop.is_set():
                    usage = kv.usage()
                    assert 0 <= usage.num_free_blocks <= usage.num_blocks == NUM_BLOCKS - 1
                    prompt = rng.choice(SHARED_PREFIXES)
                    cached = kv.lookup(prompt)
                    assert 0 <= cached <= len(prompt) - 1 and cached % BLOCK == 0
                    # Requests of the small writers and of the offloaded Steps.
                    kind = rng.choice(["", "big"])
                    rid = f"{rng.choice(self._names)}-{kind}{rng.randrange(150)}"
                    try:
                        table = kv.block_table(rid)
                    except NotFoundError:
                        pass
                    else:
                        self.tables_seen += 1
                        assert table.num_computed_tokens <= table.num_tokens
                        assert len(table.groups[0]) >= _cdiv(table.num_computed_tokens, BLOCK)
                    self.reads += 3
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


def check_pool(server: ServerThread, live: dict[str, tuple[int, int]]) -> None:
    """Every live request is as its writer left it; every block free or owned."""
    held: set[int] = set()
    tables = []
    with KVCacheClient(server.address, pool="p") as kv:
        for rid, (num_tokens, computed) in live.items():
            table = kv.block_table(rid)
            assert (table.num_tokens, table.num_computed_tokens) == (num_tokens, computed), rid
            assert len(table.groups[0]) >= _cdiv(computed, BLOCK)
            held.update(table.groups[0])
            tables.append(list(table.groups[0]))
        usage = kv.usage()
    assert usage.num_requests == len(live)
    assert usage.num_free_blocks + len(held) == usage.num_blocks == NUM_BLOCKS - 1

    def invariants() -> None:
        cache = server.server.pools.by_name["p"].cache
        check_pool_invariants(cache.manager.block_pool, tables)

    server.run(invariants)


def free_everything(server: ServerThread, live: dict[str, tuple[int, int]]) -> None:
    with KVCacheClient(server.address, pool="p") as kv:
        for rid in live:
            kv.free(rid)
        usage = kv.usage()
    assert usage.num_requests == 0
    assert usage.num_free_blocks == usage.num_blocks

    def all_back() -> None:
        pool = server.server.pools.by_name["p"].cache.manager.block_pool
        assert not any(pool.ref_cnt[1:])
        check_pool_invariants(pool, [])

    server.run(all_back)


@pytest.mark.e2e
def test_writers_in_threads_and_processes_keep_the_pool_consistent(server: ServerThread) -> None:
    thread_names = ["t0", "t1", "t2"]
    process_names = ["p0", "p1"]
    live: dict[str, tuple[int, int]] = {}
    spawn = multiprocessing.get_context("spawn")
    with (
        Readers(server.address, [*thread_names, *process_names]) as readers,
        ProcessPoolExecutor(len(process_names), mp_context=spawn) as processes,
        ThreadPoolExecutor(len(thread_names)) as threads,
    ):
        futures = [
            processes.submit(run_writer, server.address, name, 100 + i, 150)
            for i, name in enumerate(process_names)
        ]
        futures += [
            threads.submit(run_writer, server.address, name, i, 150, 3 if i == 0 else 0)
            for i, name in enumerate(thread_names)
        ]
        for future in futures:
            writer_live, calls = future.result(timeout=300)
            assert calls > 100  # each process and thread did write
            live.update(writer_live)
    assert not readers.errors, readers.errors
    assert readers.reads > 0
    check_pool(server, live)
    free_everything(server, live)


class WriterGuard:
    """Counts writes into the pool's cache that overlap across threads, and holds the
    first offloaded write until a small write has reached the server.

    A small write that reached the server either waits for the pool's lock (``contended``)
    or, were the lock missing, runs at once and overlaps the offloaded one.
    """

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self.offloaded = threading.Event()
        self.arrived = threading.Event()
        self.contended = threading.Event()
        self.overlaps = 0
        self._active: dict[int, int] = {}
        self._mutex = threading.Lock()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_ident()
            with self._mutex:
                if any(count for thread, count in self._active.items() if thread != me):
                    self.overlaps += 1
                    self.arrived.set()
                self._active[me] = self._active.get(me, 0) + 1
                first_offloaded = me != self.loop_thread and not self.offloaded.is_set()
            try:
                if first_offloaded:
                    self.offloaded.set()
                    assert self.arrived.wait(60), "no small write reached the server"
                return fn(*args, **kwargs)
            finally:
                with self._mutex:
                    self._active[me] -= 1

        return guarded

    def install(self, pool: Any) -> None:
        pool.cache = GuardedCache(pool.cache, self)
        guard = self

        class RecordingLock(asyncio.Lock):
            async def acquire(self) -> bool:
                if self.locked():
                    guard.contended.set()
                    guard.arrived.set()
                return await super().acquire()

        pool.lock = RecordingLock()


class GuardedCache:
    """The pool's cache with its writes counted by a :class:`WriterGuard`.

    A stand-in the server calls instead of the cache (the compiled core's objects cannot
    have their methods replaced); everything else goes to the cache itself.
    """

    WRITES = ("allocate", "allocate_running", "free", "lookup")

    def __init__(self, cache: Any, guard: WriterGuard) -> None:
        self._cache = cache
        for name in self.WRITES:
            setattr(self, name, guard.wrap(getattr(cache, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def test_small_writes_wait_for_an_offloaded_one(server: ServerThread) -> None:
    guard = WriterGuard(server.run(threading.get_ident))
    server.run(lambda: guard.install(server.server.pools.by_name["p"]))
    prompts = [[7000 + i] * BIG_PROMPT for i in range(BIG_ADMISSIONS)]
    assert BIG_PROMPT * BIG_ADMISSIONS > OFFLOAD_WORK_THRESHOLD

    def big_step() -> StepResultList:
        with KVCacheClient(server.address, pool="p") as kv:
            step = kv.step()
            for i, prompt in enumerate(prompts):
                step.allocate(f"big{i}", prompt, BLOCK, start=True)
            return step.send(timeout=120)

    def small_writes(name: str) -> dict[str, tuple[int, int]]:
        with KVCacheClient(server.address, pool="p") as kv:
            prompt = SHARED_PREFIXES[0] + [1, 2, 3]
            assert kv.allocate(f"{name}-a", prompt, len(prompt), start=True).ok
            assert kv.allocate(f"{name}-a", [4], 1).ok
            assert kv.allocate(f"{name}-b", prompt, len(prompt), start=True).ok
            kv.free(f"{name}-b")
            results = kv.step().allocate(f"{name}-a", [5], 1).send(timeout=60)
            assert results[0].ok
            return {f"{name}-a": (len(prompt) + 2, len(prompt) + 2)}

    with ThreadPoolExecutor(3) as threads:
        big = threads.submit(big_step)
        assert guard.offloaded.wait(60), "the big Step was not offloaded to a thread"
        small = [threads.submit(small_writes, name) for name in ("s0", "s1")]
        results = big.result(timeout=120)
        live = {f"big{i}": (BIG_PROMPT, BLOCK) for i in range(BIG_ADMISSIONS)}
        for future in small:
            live.update(future.result(timeout=120))
    assert guard.contended.is_set(), "no small write waited for the offloaded one"
    assert guard.overlaps == 0, f"{guard.overlaps} writes ran inside the offloaded one"
    assert all(result.ok for result in results)
    check_pool(server, live)
    free_everything(server, live)
