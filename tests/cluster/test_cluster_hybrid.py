"""A hybrid model's cluster index with real processes: two `kvsvc serve` with `kvsvc
worker --device cpu` on a spec of full-attention and sliding-window layers (a window that
is not a multiple of the block size), `kvsvc indexer` into a real redis-server, and
Score checked against each engine's own Lookup once traffic settles: the sliding-window
groups are tracked, so the score is the Lookup, not an upper bound."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.demo.processes import Child, spawn
from tests.cluster.redis_procs import RedisServer, free_port, require_redis_package
from tests.cluster.test_cluster_index import SEED, Engine, wait_for

pytest.importorskip("torch")
require_redis_package()
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

# Layers 0 and 2 full attention, 1 and 3 a 40-token window (2.5 blocks of 16): the
# planner makes a full-attention group and a sliding-window group.
HYBRID_SPECS = {
    f"model.layers.{i}.self_attn.attn": {
        "type": "full_attention" if i % 2 == 0 else "sliding_window",
        "block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": "float16",
        **({} if i % 2 == 0 else {"sliding_window": 40}),
    }
    for i in range(4)
}  # fmt: skip
PREFIXES = [[2000 * s + t for t in range(96)] for s in range(1, 4)]
LONG = [9000 + t for t in range(96)]
# Enough for one 1024-token request in both groups (2.02 MiB), few enough that the
# traffic evicts.
MEMORY = "2560KiB"


@dataclass
class HybridFleet:
    engines: list[Engine]
    url: str
    indexer: Child | None = None

    def start_indexer(self) -> None:
        args = ["indexer", "--redis", self.url, "--metrics-listen", "off"]
        for engine in self.engines:
            args += ["--source", engine.source]
        child = spawn("hybrid-indexer", [*args, "--log-level", "INFO"])
        wait_for(lambda: any("kvsvc indexer following" in x for x in child.lines), what="indexer")
        self.indexer = child

    def stop_indexer(self) -> None:
        if self.indexer is not None:
            self.indexer.process.kill()
            self.indexer.stop(5)
            self.indexer = None

    def lookups(self, prompt: list[int]) -> dict[str, int]:
        found = {}
        for engine in self.engines:
            with KVCacheClient(engine.address, pool="p") as kv:
                found[engine.source] = kv.lookup(prompt)
        return found

    def assert_scores_are_lookups(self, checked: list[list[int]]) -> None:
        from kvsvc.cluster.score import Scorer
        from kvsvc.cluster.store import connect

        scorer = Scorer(connect(self.url), SEED)

        def matches() -> bool:
            return all(
                scorer.score(p, max_registry_age=0).scores == self.lookups(p) for p in checked
            )

        try:
            wait_for(matches, timeout=20, what="the index to match the hybrid engines' lookups")
        except AssertionError:
            bad = next(p for p in checked if scorer.score(p).scores != self.lookups(p))
            pytest.fail(f"score {scorer.score(bad).scores} != lookups {self.lookups(bad)}")


@pytest.fixture(scope="module")
def hybrid_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HybridFleet]:
    tmp = tmp_path_factory.mktemp("hybrid")
    seed_file = tmp / "seed"
    seed_file.write_text(f"{SEED}\n")
    spec_file = tmp / "specs.json"
    spec_file.write_text(json.dumps(HYBRID_SPECS))
    engines: list[Engine] = [
        Engine(
            f"h{i}",
            free_port(),
            seed_file,
            spec_file,
            None,
            kv_cache_memory=MEMORY,
            # Every full window block cached (dense retention): the scenario below counts on
            # LONG's later window blocks being in the index after its earlier ones left.
            serve_args=("--prefix-cache-retention-interval", "-1"),
        )
        for i in range(2)
    ]
    redis = RedisServer(tmp / "redis")
    fleet = HybridFleet(engines, redis.url)
    try:
        redis.start()
        for engine in engines:
            engine.start_server()
            engine.start_worker()
        for engine in engines:
            engine.wait_ready()
        fleet.start_indexer()
        yield fleet
    finally:
        fleet.stop_indexer()
        for engine in engines:
            engine.stop()
        redis.stop()


def traffic(engines: list[Engine], rng: random.Random, rounds: int = 10) -> list[list[int]]:
    """Shared prefixes with random tails, most finished (their blocks stay cached until
    evicted), a few running. Returns the prompts."""
    prompts = []
    for engine in engines:
        with KVCacheClient(engine.address, pool="p") as kv:
            running: list[str] = []
            for i in range(rounds):
                base = rng.choice(PREFIXES)
                prompt = base[: rng.randrange(17, len(base) + 1)] + [
                    rng.randrange(50_000) for _ in range(rng.randrange(0, 40))
                ]
                request = f"{engine.name}-{time.monotonic_ns()}-{i}"
                assert kv.allocate(request, prompt, len(prompt), start=True).ok
                running.append(request)
                if len(running) > 2:
                    kv.free(running.pop(0))
                prompts.append(prompt)
            for request in running:
                kv.free(request)
    return prompts


def window_left_behind(engine: Engine, rng: random.Random) -> None:
    """A request that goes on decoding frees its sliding-window blocks before its
    window (blocks 0-2 of LONG once 96 tokens are computed) while it holds its
    full-attention blocks; unrelated traffic then evicts those freed blocks. A prefix of
    LONG is then a full-attention hit but not a sliding-window one: Lookup answers less
    than the full-attention groups alone would say."""
    with KVCacheClient(engine.address, pool="p") as kv:
        assert kv.allocate("long", LONG, len(LONG), start=True).ok
        for token in (5, 6):  # decode steps: the window moves past blocks 0-2
            assert kv.allocate("long", [token], 1).ok
        for i in range(30):  # pressure: the free queue's oldest blocks are reused
            other = [rng.randrange(60_000, 90_000) for _ in range(130)]
            assert kv.allocate(f"other-{i}", other, len(other), start=True).ok
            kv.free(f"other-{i}")


def test_score_equals_each_hybrid_engines_lookup(hybrid_fleet: HybridFleet) -> None:
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    fleet = hybrid_fleet
    engines = fleet.engines
    rng = random.Random(13)
    prompts = traffic(engines, rng)
    window_left_behind(engines[0], rng)
    checked = [
        [*LONG, 5],
        *prompts,
        *PREFIXES,
        *(p[:n] for p in [*PREFIXES, LONG] for n in (17, 33, 50, 81)),
    ]
    # A token changed inside a cached prefix: full attention misses after it, the window
    # may still hit before it.
    for prompt in prompts[:6]:
        changed = list(prompt)
        changed[rng.randrange(1, 16)] = 77_777
        checked.append(changed)
    fleet.assert_scores_are_lookups(checked)
    lookups = fleet.lookups
    assert any(v > 0 for p in checked for v in lookups(p).values()), "nothing cached"
    # The window's rule was needed: LONG's blocks are all cached in the full-attention
    # group (held by "long"), its sliding-window blocks 0-2 were evicted. A hit at 80
    # tokens needs window blocks 2-4: none; at 96, blocks 3-5: all there.
    assert lookups(LONG[:81])[engines[0].source] == 0
    assert lookups([*LONG, 5])[engines[0].source] == 96
    scorer = Scorer(connect(fleet.url), SEED)
    result = scorer.score(PREFIXES[0], max_registry_age=0)
    assert result.upper_bound == (), "every group of the hybrid spec is tracked"
    for _, tracking in scorer.registry(0).engines.values():
        assert [(c.window, c.block_size) for c in tracking.classes] == [(40, 16)]


def test_a_source_indexed_before_windows_were_tracked_is_upgraded(
    hybrid_fleet: HybridFleet,
) -> None:
    """Redis holds the sources as an older indexer wrote them (meta and registry without
    classes: full attention only). They load as such (an upper bound: LONG[:81] scores
    80), and the indexer started on them snapshots them again: scores are Lookups."""
    from kvsvc.cluster.layout import Keys
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    fleet = hybrid_fleet
    fleet.stop_indexer()
    client = connect(fleet.url)
    keys = Keys()
    new_fields = ("classes", "align", "untracked")
    for engine in fleet.engines:
        client.hdel(keys.source(engine.source, "meta"), *new_fields)
        info = json.loads(client.hget(keys.sources, engine.source))
        old = {k: v for k, v in info.items() if k not in new_fields}
        client.hset(keys.sources, engine.source, json.dumps(old, sort_keys=True))
    scorer = Scorer(client, SEED)
    trackings = [t for _, t in scorer.registry(0).engines.values()]
    assert all(t.legacy and t.classes == () for t in trackings)
    source = fleet.engines[0].source
    assert scorer.score(LONG[:81], max_registry_age=0).scores[source] == 80
    fleet.start_indexer()
    fleet.assert_scores_are_lookups([LONG[:81], [*LONG, 5], *PREFIXES])
    assert scorer.score(LONG[:81], max_registry_age=0).scores[source] == 0
    trackings = [t for _, t in scorer.registry(0).engines.values()]
    assert all(not t.legacy and len(t.classes) == 1 for t in trackings)
