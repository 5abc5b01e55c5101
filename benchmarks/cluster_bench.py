"""Benchmark of the cluster index (kvsvc.cluster) on one redis-server it starts itself.

What it measures, in one run:

- indexer throughput: a synthetic fleet of ``--engines`` engines (1,000) whose event
  streams are generated in process (shared system prompts plus per-engine turns, with
  evictions) and applied through the indexer's own write path (``_events_to_ops`` and
  ``SourceStore.apply``: the lease-fenced script, then the bits), by ``--threads`` writers
  as the followers would; block events per second into one redis-server;
- the same end to end with real servers: ``--servers`` `kvsvc serve` processes, each with
  a `kvsvc worker --device cpu`, driven by engines in this process while an in-process
  ``Indexer`` follows their WatchEvents (block events per second it applied, and its lag);
- Score for a 4,096-token prompt over the 1,000 engines (each holding a different prefix
  of it): p50 / p99 of ``Scorer.score``, next to the p50 / p99 of one Redis round trip
  (PING) measured in the same run, with redis-py's hiredis parser and its pure-Python one;
  and the same over 1,000 hybrid engines (full attention + a 1,024-token sliding window,
  the window's blocks with holes), scored by the hybrid rule;
- Route for the same prompt over the same 1,000 engines, each with a load report
  (``Router.route``: the bitmaps, the load vector and Redis's time in one pipelined round
  trip, then the policy over every engine), p50 / p99 with both parsers, beside Score's in
  the same run;
- Redis memory per indexed block: ``used_memory`` grown by the index, divided by the
  (engine, block) entries it holds, and by its distinct block hashes.

Run ``python benchmarks/cluster_bench.py`` for the table, ``--json`` for one object,
``--quick`` for a smoke run (100 engines, fewer events, no real servers). It needs
``redis-server`` on PATH and the ``cluster`` extra.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsvc.cluster.hashing import PromptHasher
from kvsvc.cluster.indexer import _events_to_ops
from kvsvc.cluster.layout import Keys
from kvsvc.cluster.load import LoadPublisher
from kvsvc.cluster.route import Router
from kvsvc.cluster.score import Scorer, TokenPrompt
from kvsvc.cluster.store import SourceStore, Tracking, connect
from kvsvc.replay.fleet import FleetError, PrivateRedis

SEED = "cluster-bench-seed"
BLOCK = 16


@dataclass(frozen=True, slots=True)
class _Stored:
    block_hashes: tuple[bytes, ...]
    group_index: int = 0


@dataclass(frozen=True, slots=True)
class _Removed:
    block_hashes: tuple[bytes, ...]
    group_index: int = 0


@dataclass(frozen=True, slots=True)
class _Batch:
    events: tuple[Any, ...]


def _redis() -> PrivateRedis:
    """A redis-server of the bench's own (the replay's: no persistence, a free port)."""
    try:
        return PrivateRedis()
    except FleetError as exc:
        sys.exit(f"cluster_bench: {exc}")


def client(url: str, hiredis: bool) -> Any:
    import redis
    from redis._parsers import _HiredisParser, _RESP2Parser

    parser = _HiredisParser if hiredis else _RESP2Parser
    return redis.Redis.from_url(url, parser_class=parser, socket_timeout=10)


def has_hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


def tracking() -> Tracking:
    return Tracking((0,), BLOCK, BLOCK, "xxh3_128", PromptHasher("xxh3_128", SEED).fingerprint)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- indexer throughput -----------------------------------------------------------------


def synthetic_streams(engines: int, batches: int, rng: random.Random) -> list[list[_Batch]]:
    """Per engine, ``batches`` event batches: an admission stores the blocks of a system
    prompt (one of 8, 64 blocks) that the engine lacks and a 4-12 block turn; past 256
    cached blocks its oldest runs leave (system prompts too), as an LRU pool would."""
    systems = [tuple(rng.randbytes(16) for _ in range(64)) for _ in range(8)]
    streams = []
    for _ in range(engines):
        cached: dict[int, tuple[bytes, ...]] = {}  # run id -> hashes, oldest first
        system_runs: dict[int, int] = {}  # system prompt -> its run id while cached
        held = 0
        stream = []
        for n in range(batches):
            events: list[Any] = []
            s = rng.randrange(len(systems))
            if s not in system_runs:
                system_runs[s] = -1 - n
                cached[-1 - n] = systems[s]
                events.append(_Stored(systems[s]))
                held += 64
            turn = tuple(rng.randbytes(16) for _ in range(rng.randrange(4, 13)))
            cached[n] = turn
            events.append(_Stored(turn))
            held += len(turn)
            while held > 256:
                run_id = next(iter(cached))
                old = cached.pop(run_id)
                for system, rid in list(system_runs.items()):
                    if rid == run_id:
                        del system_runs[system]
                events.append(_Removed(old))
                held -= len(old)
            stream.append(_Batch(tuple(events)))
        streams.append(stream)
    return streams


def bench_indexer(
    url: str, engines: int, batches: int, threads: int, run_events: int, prefix: str
) -> dict[str, Any]:
    from kvsvc_client import BlockRemoved, BlockStored

    rng = random.Random(1)
    # The indexer's converter reads kvsvc_client's event types: make the synthetic ones.
    streams = [
        [
            _Batch(
                tuple(
                    BlockStored(e.block_hashes, None, (), BLOCK, "", "GPU", 0, "full_attention")
                    if isinstance(e, _Stored)
                    else BlockRemoved(e.block_hashes, "GPU", 0)
                    for e in batch.events
                )
            )
            for batch in stream
        ]
        for stream in synthetic_streams(engines, batches, rng)
    ]
    keys = Keys(prefix)
    redis_client = connect(url, cluster=False)
    track = tracking()
    stores = []
    for i in range(engines):
        store = SourceStore(
            redis_client, f"10.0.{i // 250}.{i % 250}:50051/llama", "bench", keys, 3600
        )
        store.acquire()
        store.install("epoch", 0, track, {})
        stores.append(store)
    total_events = sum(
        len(e.block_hashes) for stream in streams for batch in stream for e in batch.events
    )
    tracked = frozenset(track.groups)

    def run(indexes: range) -> None:
        for i in indexes:
            store, stream = stores[i], streams[i]
            seq = 0
            position = 0
            while position < len(stream):
                ops: list[bytes] = []
                first = seq + 1
                while position < len(stream) and len(ops) < run_events:
                    batch_ops, *_ = _events_to_ops(stream[position], tracked)
                    ops.extend(batch_ops)
                    position += 1
                    seq += 1
                store.apply("epoch", first, seq, track, ops)

    per = -(-engines // threads)
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, [range(k, min(engines, k + per)) for k in range(0, engines, per)]))
    elapsed = time.perf_counter() - started
    return {
        "engines": engines,
        "block_events": total_events,
        "seconds": elapsed,
        "events_per_s": total_events / elapsed,
        "threads": threads,
        "run_events": run_events,
    }


# -- Score -------------------------------------------------------------------------------


def populate_for_score(url: str, engines: int, prompt: list[int]) -> dict[str, int]:
    """Engine i holds the first i % (blocks + 1) blocks of the prompt; returns the scores
    that makes (capped: at least one token is left to compute)."""
    hasher = PromptHasher("xxh3_128", SEED)
    hashes = hasher.block_hashes(prompt, BLOCK, BLOCK)
    keys = Keys("score")
    redis_client = connect(url, cluster=False)
    track = tracking()
    expected = {}
    cap = (len(prompt) - 1) // BLOCK
    for i in range(engines):
        name = f"10.1.{i // 250}.{i % 250}:50051/llama"
        store = SourceStore(redis_client, name, "bench", keys)
        store.acquire()
        held = hashes[: i % (len(hashes) + 1)]
        store.install("epoch", 0, track, {b"\0" + h: 1 for h in held})
        expected[name] = min(len(held), cap) * BLOCK
    return expected


HYBRID_WINDOW = 1024


def hybrid_hit(full: int, window: set[int], max_blocks: int, needed: int) -> int:
    """The server's hit rule for one full-attention and one sliding-window group of one
    block size, written plainly (blocks): the longest length whose full-attention blocks
    are all cached and whose last ``needed`` window blocks (all, from block 0, when
    fewer) are."""
    for length in range(min(full, max_blocks), 0, -1):
        if all(b in window for b in range(max(0, length - needed), length)):
            return length
    return 0


def populate_for_hybrid_score(url: str, engines: int, prompt: list[int]) -> dict[str, int]:
    """Hybrid engine i holds a prefix of the prompt in its full-attention group and the
    same blocks but a few (evicted) in its sliding-window group; returns the scores the
    rule gives."""
    hasher = PromptHasher("xxh3_128", SEED)
    hashes = hasher.block_hashes(prompt, BLOCK, BLOCK)
    keys = Keys("score-hybrid")
    redis_client = connect(url, cluster=False)
    track = Tracking.from_groups(
        [(0, "full_attention", BLOCK, 0), (1, "sliding_window", BLOCK, HYBRID_WINDOW)],
        BLOCK, "xxh3_128", hasher.fingerprint,
    )  # fmt: skip
    rng = random.Random(2)
    needed = -(-(HYBRID_WINDOW - 1) // BLOCK)
    cap = (len(prompt) - 1) // BLOCK
    expected = {}
    for i in range(engines):
        name = f"10.2.{i // 250}.{i % 250}:50051/gemma"
        store = SourceStore(redis_client, name, "bench", keys)
        store.acquire()
        full = i % (len(hashes) + 1)
        window = set(range(full)) - {rng.randrange(len(hashes)) for _ in range(3)}
        counts = {b"\0" + hashes[b]: 1 for b in range(full)}
        counts.update({b"\1" + hashes[b]: 1 for b in window})
        store.install("epoch", 0, track, counts)
        expected[name] = hybrid_hit(full, window, cap, needed) * BLOCK
    return expected


def bench_score(
    url: str,
    prompt: list[int],
    expected: dict[str, int],
    calls: int,
    hiredis: bool,
    prefix: str = "score",
) -> dict[str, Any]:
    redis_client = client(url, hiredis)
    scorer = Scorer(redis_client, SEED, Keys(prefix))
    assert scorer.score(prompt).scores == expected, "the scores the index should give"
    score_ms, rtt_ms = [], []
    for _ in range(calls):  # interleaved, so both see the same machine
        t0 = time.perf_counter()
        redis_client.ping()
        t1 = time.perf_counter()
        scorer.score(prompt)
        t2 = time.perf_counter()
        rtt_ms.append((t1 - t0) * 1e3)
        score_ms.append((t2 - t1) * 1e3)
    return {
        "parser": "hiredis" if hiredis else "python",
        "score_p50_ms": statistics.median(score_ms),
        "score_p99_ms": percentile(score_ms, 0.99),
        "rtt_p50_ms": statistics.median(rtt_ms),
        "rtt_p99_ms": percentile(rtt_ms, 0.99),
    }


def publish_loads(url: str, names: list[str], prefix: str = "score") -> None:
    """A load report for every engine (running requests 0-7, as a fleet would have)."""
    keys = Keys(prefix)
    redis_client = connect(url, cluster=False)
    loads = LoadPublisher(redis_client, keys, ttl_s=3600)
    for i, name in enumerate(names):
        engine = SourceStore(redis_client, name, "bench", keys).ensure_id()
        loads.publish(engine, i % 8, 32 * (i % 8), 4096)


def bench_route(
    url: str, prompt: list[int], expected: dict[str, int], calls: int, hiredis: bool
) -> dict[str, Any]:
    """Route over the engines of ``expected`` (indexed, each with a load report), Score in
    the same loop: p50 / p99 of each."""
    redis_client = client(url, hiredis)
    scorer = Scorer(redis_client, SEED, Keys("score"))
    router = Router(Scorer(redis_client, SEED, Keys("score")))
    first = router.route(TokenPrompt(prompt))
    assert first.num_candidates == len(expected), "every engine weighed"
    assert first.chosen.report is not None, "the engines' loads were read"
    assert first.chosen.cached == expected[first.chosen.engine]
    route_ms, score_ms = [], []
    for _ in range(calls):  # interleaved, so both see the same machine
        t0 = time.perf_counter()
        router.route(TokenPrompt(prompt))
        t1 = time.perf_counter()
        scorer.score(prompt)
        t2 = time.perf_counter()
        route_ms.append((t1 - t0) * 1e3)
        score_ms.append((t2 - t1) * 1e3)
    return {
        "parser": "hiredis" if hiredis else "python",
        "route_p50_ms": statistics.median(route_ms),
        "route_p99_ms": percentile(route_ms, 0.99),
        "score_p50_ms": statistics.median(score_ms),
        "score_p99_ms": percentile(score_ms, 0.99),
    }


def redis_memory(url: str) -> int:
    return int(connect(url, cluster=False).info("memory")["used_memory"])


# -- real servers ------------------------------------------------------------------------


SPECS = {
    f"model.layers.{i}.self_attn.attn": {
        "type": "full_attention", "block_size": BLOCK, "num_kv_heads": 2, "head_size": 64,
        "dtype": "float16",
    }
    for i in range(2)
}  # fmt: skip


def bench_real_servers(url: str, servers: int, seconds: float) -> dict[str, Any]:
    """`kvsvc serve` + `kvsvc worker` per server, engines in threads here, an in-process
    Indexer following them into Redis."""
    from kvsvc_client import KVCacheClient

    from kvsvc.cluster.indexer import Indexer
    from kvsvc.cluster.metrics import IndexerMetrics
    from kvsvc.cluster.source import IndexerOptions
    from kvsvc.demo.processes import spawn, stop_all, wait_for_ports

    tmp = Path(tempfile.mkdtemp(prefix="kvsvc-bench-"))
    (tmp / "seed").write_text(SEED)
    (tmp / "specs.json").write_text(json.dumps(SPECS))
    children = []
    addresses = []
    try:
        for i in range(servers):
            server = spawn(f"server{i}", [
                "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p",
                "--max-model-len", "2048", "--hash-seed-file", str(tmp / "seed"),
                "--log-level", "WARNING",
            ])  # fmt: skip
            port, _ = wait_for_ports(server)
            children.append(server)
            addresses.append(f"127.0.0.1:{port}")
            children.append(spawn(f"worker{i}", [
                "worker", "--server", addresses[-1], "--pool", "p", "--rank", "0",
                "--world-size", "1", "--device", "cpu", "--spec-file", str(tmp / "specs.json"),
                "--kv-cache-memory", "64MiB",
            ]))  # fmt: skip
        for address in addresses:
            with KVCacheClient(address, pool="p") as kv:
                kv.wait_until_ready(timeout=120)
        metrics = IndexerMetrics()
        indexer = Indexer(connect(url, cluster=False), IndexerOptions(keys=Keys("real")), metrics)
        indexer.set_sources(f"{a}/p" for a in addresses)
        indexer.wait_caught_up(30)
        stop = threading.Event()
        requests = [0]

        def engine(address: str, seed: int) -> None:
            rng = random.Random(seed)
            systems = [[1000 * s + t for t in range(512)] for s in range(1, 9)]
            with KVCacheClient(address, pool="p") as kv:
                n = 0
                while not stop.is_set():
                    prompt = rng.choice(systems) + [rng.randrange(50_000) for _ in range(256)]
                    rid = f"r{n}"
                    if kv.allocate(rid, prompt, len(prompt), start=True).ok:
                        kv.free(rid)
                    n += 1
                    requests[0] += 1

        def applied() -> float:
            return sum(metrics.events.labels(kind)._value.get() for kind in ("stored", "removed"))

        before = applied()
        threads = [
            threading.Thread(target=engine, args=(a, i), daemon=True)
            for i, a in enumerate(addresses)
        ]
        started = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(10)
        elapsed = time.perf_counter() - started
        # Drained: what the servers made has been applied once the lag settles.
        time.sleep(1.0)
        events = applied() - before
        lags = [metrics.lag.labels(f"{a}/p")._value.get() for a in addresses]
        indexer.stop()
        return {
            "servers": servers,
            "requests": requests[0],
            "block_events": events,
            "events_per_s": events / elapsed,
            "max_lag_s": max(lags),
        }
    finally:
        stop_all(children)
        shutil.rmtree(tmp, ignore_errors=True)


# -- main --------------------------------------------------------------------------------


def route_only(args: argparse.Namespace) -> int:
    """Route and Score over the same engines, with one Redis round trip (PING) measured
    in the same run."""
    redis = _redis()
    try:
        prompt = list(range(100, 100 + 4096))
        expected = populate_for_score(redis.url, args.engines, prompt)
        publish_loads(redis.url, list(expected))
        parsers = [True, False] if has_hiredis() else [False]
        pings = [bench_score(redis.url, prompt, expected, args.score_calls, h) for h in parsers]
        route = [bench_route(redis.url, prompt, expected, args.score_calls, h) for h in parsers]
    finally:
        redis.stop()
    if args.json:
        print(json.dumps({"cpus": os.cpu_count(), "score": pings, "route": route}, indent=2))
        return 0
    for r, p in zip(route, pings, strict=True):
        print(
            f"{args.engines} engines, {r['parser']} parser: Route p50 / p99 "
            f"{r['route_p50_ms']:.2f} / {r['route_p99_ms']:.2f} ms; Score in the same loop "
            f"{r['score_p50_ms']:.2f} / {r['score_p99_ms']:.2f} ms; PING "
            f"{p['rtt_p50_ms']:.3f} / {p['rtt_p99_ms']:.3f} ms"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=60, help="event batches per engine")
    parser.add_argument("--threads", type=int, default=4, help="indexer writer threads")
    parser.add_argument("--servers", type=int, default=2, help="real kvsvc servers (0: none)")
    parser.add_argument("--score-calls", type=int, default=2000)
    parser.add_argument(
        "--route-only",
        action="store_true",
        help="only Route and Score side by side, with PING (a minute: for a quiet moment "
        "on a shared machine)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.engines, args.batches, args.servers, args.score_calls = 100, 10, 0, 200
    if args.route_only:
        return route_only(args)
    redis = _redis()
    try:
        base = redis_memory(redis.url)
        # Live: the indexer keeps up, so every script call carries one batch. Catching
        # up (after a pause, or behind a burst): runs of up to 20,000 events per call,
        # in which a block stored and evicted again nets out.
        live = bench_indexer(redis.url, args.engines, args.batches, args.threads, 1, "live")
        indexer = bench_indexer(
            redis.url, args.engines, args.batches, args.threads, 20_000, "behind"
        )
        r = connect(redis.url, cluster=False)
        # The index both runs left (the same final state twice: one is measured).
        entries = sum(int(r.hlen(k)) for k in r.scan_iter(match="live:{live:src:*}:blocks"))
        distinct = sum(1 for _ in r.scan_iter(match="live:b:*", count=10_000))
        grown = (redis_memory(redis.url) - base) / 2
        # Where it goes: the sources' count hashes and the block bitmaps (MEMORY USAGE of
        # every count hash, of a sample of bitmaps).
        counts_bytes = sum(
            int(r.memory_usage(k, samples=0) or 0)
            for k in r.scan_iter(match="live:{live:src:*}:blocks")
        )
        sample = list(itertools.islice(r.scan_iter(match="live:b:*", count=1000), 2000))
        bitmap_bytes = statistics.mean(int(r.memory_usage(k) or 0) for k in sample)
        prompt = list(range(100, 100 + 4096))
        expected = populate_for_score(redis.url, args.engines, prompt)
        parsers = [True, False] if has_hiredis() else [False]
        score = [bench_score(redis.url, prompt, expected, args.score_calls, h) for h in parsers]
        publish_loads(redis.url, list(expected))
        route = [bench_route(redis.url, prompt, expected, args.score_calls, h) for h in parsers]
        hybrid_expected = populate_for_hybrid_score(redis.url, args.engines, prompt)
        hybrid = [
            bench_score(redis.url, prompt, hybrid_expected, args.score_calls, h, "score-hybrid")
            for h in parsers
        ]
        real = bench_real_servers(redis.url, args.servers, 8.0) if args.servers else None
    finally:
        redis.stop()
    results = {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "indexer_live": live,
        "indexer_behind": indexer,
        "memory": {
            "entries": entries,
            "distinct_blocks": distinct,
            "bytes": grown,
            "bytes_per_entry": grown / max(1, entries),
            "bytes_per_distinct_block": grown / max(1, distinct),
            "count_bytes_per_entry": counts_bytes / max(1, entries),
            "bitmap_bytes_per_block": bitmap_bytes,
        },
        "score": score,
        "route": route,
        "score_hybrid": hybrid,
        "real_servers": real,
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    rows = [
        ("indexer: block events/s into one redis-server, live (one batch per script call; "
         f"{live['engines']} engines, {live['block_events']:,} events, "
         f"{live['threads']} writers)", f"{live['events_per_s']:,.0f}", ">= 100,000"),
        ("indexer: the same, catching up (runs of <= 20,000 events per call)",
         f"{indexer['events_per_s']:,.0f}", ">= 100,000"),
    ]  # fmt: skip
    if real is not None:
        rows.append(
            (
                f"indexer end to end: {real['servers']} real servers, events applied/s (max lag)",
                f"{real['events_per_s']:,.0f} ({real['max_lag_s'] * 1e3:.0f} ms)",
                "",
            )
        )
    for s in score:
        rows.append(
            (
                f"Score, 4,096 tokens over {args.engines} engines, p50 / p99 "
                f"({s['parser']} parser)",
                f"{s['score_p50_ms']:.2f} / {s['score_p99_ms']:.2f} ms",
                f"p99 < 2 ms + RTT ({2 + s['rtt_p99_ms']:.2f} ms)",
            )
        )
        rows.append(
            (
                f"Redis round trip (PING), p50 / p99 ({s['parser']} parser)",
                f"{s['rtt_p50_ms']:.3f} / {s['rtt_p99_ms']:.3f} ms",
                "",
            )
        )
    for s in route:
        rows.append(
            (
                f"Route, 4,096 tokens over {args.engines} engines with their loads, p50 / p99 "
                f"({s['parser']} parser)",
                f"{s['route_p50_ms']:.2f} / {s['route_p99_ms']:.2f} ms",
                f"p99 <= 2 ms; Score in the same loop {s['score_p50_ms']:.2f} / "
                f"{s['score_p99_ms']:.2f} ms",
            )
        )
    for s in hybrid:
        rows.append(
            (
                f"Score, 4,096 tokens over {args.engines} hybrid engines (full + "
                f"{HYBRID_WINDOW}-token window), p50 / p99 ({s['parser']} parser)",
                f"{s['score_p50_ms']:.2f} / {s['score_p99_ms']:.2f} ms",
                f"RTT p99 in the same calls {s['rtt_p99_ms']:.2f} ms",
            )
        )
    m = results["memory"]
    rows.append(
        (
            f"Redis memory per indexed block ({m['entries']:,} engine-block entries, "
            f"{m['distinct_blocks']:,} distinct blocks)",
            f"{m['bytes_per_entry']:.0f} B per entry in all ({m['count_bytes_per_entry']:.0f} "
            f"B of counts per entry, {m['bitmap_bytes_per_block']:.0f} B per block's bitmap)",
            "",
        )
    )
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':<{value_width}}  goal")
    print(f"{'-' * width}  {'-' * value_width}  ----")
    for label, value, goal in rows:
        print(f"{label:<{width}}  {value:<{value_width}}  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
