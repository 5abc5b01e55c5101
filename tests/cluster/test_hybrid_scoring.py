"""Score of hybrid models (full attention + sliding window, and sliding window alone)
against kvsvc's own core: real PoolKVCaches drive shared-prefix admissions, frees,
evictions and clears, their events go through the store into a real redis-server (one,
and a 3-node Redis Cluster for the two-step write), and every engine's score must equal
what the core's ``lookup`` (``HybridCoordinator.find_longest_cache_hit``) answers."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvsvc.cli import main as cli_main
from kvsvc.cluster.layout import Keys
from kvsvc.cluster.lease import LeaseKeeper
from kvsvc.cluster.router import ScoreServicer
from kvsvc.cluster.score import Scorer, _window_ands
from kvsvc.cluster.store import SourceStore, Tracking, connect
from kvsvc.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvsvc.core.managers import representative_spec
from kvsvc.core.pool import PoolKVCache
from kvsvc.core.pool_types import RequestStart
from kvsvc.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvsvc.v1 import cluster_pb2
from tests.cluster.redis_procs import redis_deployment, require_redis_package

require_redis_package()

SEED = "hybrid-scoring-seed"
_prefixes = itertools.count()


def full(block_size: int, heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=1, dtype="float32"
    )


def window(block_size: int, tokens: int, heads: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=heads, head_size=1, dtype="float32",
        sliding_window=tokens,
    )  # fmt: skip


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32",
        attention_chunk_size=chunk,
    )  # fmt: skip


# The models: windows that are and are not multiples of the block size, two windows,
# groups of another block size (the hit aligned to the lcm), two groups of one class (a
# block must be in both), full attention of two block sizes, and sliding window alone.
MODELS: dict[str, list[KVCacheSpec]] = {
    "full4+window8x2": [full(4), window(4, 8), window(4, 8, heads=2)],
    "full4+window10@8": [full(4), window(8, 10)],
    "full8+windows6,16@4": [full(8), window(4, 6), window(4, 16)],
    "full4+full8+window5": [full(4), full(8), window(4, 5)],
    "window7": [window(4, 7)],
    "windows5@4,12@8": [window(4, 5), window(8, 12)],
    "window1+full4": [window(4, 1), full(4)],
}
ENGINES_PER_MODEL = 3


def groups_of(cache: PoolKVCache) -> list[tuple[int, str, int, int]]:
    """The pool's groups as SnapshotIndex describes them (index, kind, block size,
    sliding window)."""
    out = []
    groups = cache.manager.kv_cache_config.kv_cache_groups
    for i, (kind, group) in enumerate(zip(cache.group_kinds, groups, strict=True)):
        rule = representative_spec(group.kv_cache_spec)
        size = rule.sliding_window if isinstance(rule, SlidingWindowSpec) else 0
        out.append((i, kind, group.kv_cache_spec.block_size, size))
    return out


def ops_of(batch: KVEventBatch, tracked: frozenset[int]) -> list[bytes]:
    """A core event batch as the store's ops (what the indexer makes of WatchEvents)."""
    ops: list[bytes] = []
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            ops.append(b"C")
        elif isinstance(event, BlockStored | BlockRemoved) and event.group_index in tracked:
            tag = (b"S" if isinstance(event, BlockStored) else b"R") + bytes([event.group_index])
            ops.extend(tag + h for h in event.block_hashes)
    return ops


@dataclass
class Engine:
    """One core pool and the store that indexes it."""

    name: str
    cache: PoolKVCache
    store: SourceStore
    tracking: Tracking
    rng: random.Random
    held: list[str] = field(default_factory=list)
    made: int = 0

    def sync(self) -> None:
        """Apply the pool's events so far."""
        batch = self.cache.take_events()
        if batch is not None:
            ops = ops_of(batch, self.tracking.tracked_groups)
            self.store.apply("e1", batch.seq, batch.seq, self.tracking, ops)

    def step(self, prefixes: Sequence[list[int]]) -> list[int]:
        """One admission of a shared prefix plus a random tail, some frees, and now and
        then an eviction of cached blocks (holes inside a prefix) or a clear."""
        rng = self.rng
        base = rng.choice(prefixes)
        prompt = base[: rng.randrange(1, len(base) + 1)] + [
            rng.randrange(10_000, 20_000) for _ in range(rng.randrange(0, 20))
        ]
        self.made += 1
        request = f"{self.name}-{self.made}"
        if self.cache.allocate(request, prompt, len(prompt), start=RequestStart()).ok:
            self.held.append(request)
        while len(self.held) > 2 or (self.held and rng.random() < 0.3):
            self.cache.free([self.held.pop(rng.randrange(len(self.held)))])
        roll = rng.random()
        if roll < 0.15:
            blocks = self.cache.manager.block_pool.num_blocks
            self.cache.evict_blocks(rng.sample(range(1, blocks), 3))
        elif roll < 0.17 and not self.held:
            assert self.cache.reset_prefix_cache()
        self.sync()
        return prompt


@pytest.fixture(scope="module", params=["single", "cluster"])
def redis_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with redis_deployment(tmp_path_factory.mktemp(f"redis-{request.param}"), request.param) as url:
        yield url


@pytest.fixture()
def keepers() -> Iterator[list[LeaseKeeper]]:
    """The lease keepers of a test's stores, closed when it ends."""
    started: list[LeaseKeeper] = []
    yield started
    for keeper in started:
        keeper.close()


def make_engines(
    client: object,
    keys: Keys,
    models: dict[str, list[KVCacheSpec]],
    keepers: list[LeaseKeeper],
) -> list[Engine]:
    """Engines of ``models``, each indexed by a store that holds its source's lease the
    way the indexer does: a LeaseKeeper renews it while the test writes. (Taken once and
    never renewed, the lease lapsed under a test that ran past its 30 s on a loaded
    machine, and the next write raised LeaseLost.)"""
    engines = []
    for m, (model, specs) in enumerate(models.items()):
        config = KVCacheConfig(
            num_blocks=48,  # few: admissions evict each other's blocks
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
        )
        for e in range(ENGINES_PER_MODEL):
            cache = PoolKVCache(config, max_model_len=256, hash_algo="xxh3_128", hash_seed=SEED)
            tracking = Tracking.from_groups(
                groups_of(cache), cache.hash_block_size, cache.hash_algo,
                Scorer(client, SEED, keys)._hasher("xxh3_128").fingerprint,
            )  # fmt: skip
            name = f"10.0.{m}.{e}:1/{model}"
            store = SourceStore(client, name, "owner", keys, lease_ttl_s=30)
            assert store.acquire() == "new"
            keeper = LeaseKeeper(store, name)
            keepers.append(keeper)
            keeper.start()
            keeper.hold()
            store.install("e1", 0, tracking, {})
            engines.append(Engine(name, cache, store, tracking, random.Random(f"{model}/{e}")))
    return engines


def prompts_to_check(prefixes: Sequence[list[int]], made: Sequence[list[int]]) -> list[list[int]]:
    """Every prefix length of the shared prefixes, what was admitted, and those with a
    token changed inside (a miss in the middle: a window may still hit after it)."""
    checked = [p[:n] for p in prefixes for n in range(1, len(p) + 1, 3)]
    checked += list(made[-40:])
    rng = random.Random(5)
    for prompt in made[-20:]:
        if len(prompt) > 8:
            changed = list(prompt)
            changed[rng.randrange(len(changed) - 4)] = 99_999
            checked.append(changed)
    return checked


def assert_scores_are_lookups(
    scorer: Scorer, engines: Sequence[Engine], prompts: list[list[int]]
) -> None:
    for prompt in prompts:
        scores = scorer.score(prompt, max_registry_age=0).scores
        lookups = {e.name: e.cache.lookup(prompt) for e in engines}
        assert scores == lookups, f"prompt of {len(prompt)} tokens: {scores} != {lookups}"


def test_hybrid_scores_equal_the_cores_lookups(redis_url: str, keepers: list[LeaseKeeper]) -> None:
    client = connect(redis_url)
    keys = Keys(f"hy{next(_prefixes)}")
    engines = make_engines(client, keys, MODELS, keepers)
    scorer = Scorer(client, SEED, keys)
    base = random.Random(3)
    prefixes = [[1000 * s + base.randrange(1000) for _ in range(72)] for s in range(1, 4)]
    made: list[list[int]] = []
    hits = 0
    for _round in range(6):
        for _ in range(10):
            for engine in engines:
                made.append(engine.step(prefixes))
        checked = prompts_to_check(prefixes, made)
        assert_scores_are_lookups(scorer, engines, checked)
        hits += sum(1 for p in checked[:50] for e in engines if e.cache.lookup(p))
    assert hits > 100, "the traffic left too little cached to test anything"
    # A snapshot of each pool installed over its index (the indexer's resync) changes
    # nothing; purging every source leaves no bitmap behind.
    for engine in engines:
        sequence = engine.cache.manager.events.last_seq  # type: ignore[union-attr]
        engine.store.install("e1", sequence, engine.tracking, counts_of(engine))
    assert_scores_are_lookups(scorer, engines, prompts_to_check(prefixes, made))
    for engine in engines:
        engine.store.purge()
    left = list(client.scan_iter(match=f"{keys.prefix}:[bw]:*"))  # every node of a cluster
    assert not left, f"bitmaps left after every source was purged: {left[:3]}"


def counts_of(engine: Engine) -> dict[bytes, int]:
    """The pool's index as SnapshotIndex sends it: group byte + hash -> blocks."""
    pool = engine.cache.manager.block_pool
    counts = {}
    for group in engine.tracking.tracked_groups:
        for h in pool.cached_index(group):
            counts[bytes([group]) + h] = len(pool.cached_blocks_of(h, group))
    return counts


def test_an_untracked_kind_makes_the_score_an_upper_bound(
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    keepers: list[LeaseKeeper],
) -> None:
    """Chunked local attention is not indexed: the score is the tracked classes' hit
    (at least the Lookup), and the result names the engine."""
    client = connect(redis_url)
    keys = Keys(f"hy{next(_prefixes)}")
    engines = make_engines(client, keys, {"full4+chunk8": [full(4), chunked(4, 8)]}, keepers)
    assert all(e.tracking.untracked == (1,) for e in engines)
    scorer = Scorer(client, SEED, keys)
    prefixes = [[7 * t + s for t in range(60)] for s in range(3)]
    made = [engine.step(prefixes) for _ in range(15) for engine in engines]
    for prompt in prompts_to_check(prefixes, made):
        result = scorer.score(prompt, max_registry_age=0)
        assert set(result.upper_bound) == {e.name for e in engines}
        for engine in engines:
            assert result.scores[engine.name] >= engine.cache.lookup(prompt)
    # A router's client hears it too (ScoreResponse.upper_bound).
    request = cluster_pb2.ScoreRequest(token_ids=prompts_to_check(prefixes, made)[0])
    reply = ScoreServicer(scorer).Score(request, context=None)
    assert set(reply.upper_bound) == {e.name for e in engines}
    # And `kvsvc ctl score` warns of each (its --json stays {"scores": ...}).
    seed_file = tmp_path / "seed"
    seed_file.write_text(SEED)
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(" ".join(map(str, request.token_ids)))
    argv = ["ctl", "score", "--redis", redis_url, "--tokens-file", str(tokens_file)]
    argv += ["--hash-seed-file", str(seed_file), "--key-prefix", keys.prefix, "--json"]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert set(json.loads(out)) == {"scores"}
    for engine in engines:
        assert f"{engine.name} has KV cache groups the index does not track" in err


def test_window_ands_are_the_ands_of_each_window() -> None:
    rng = random.Random(11)
    for size in (0, 1, 5, 17, 40):
        present = [rng.getrandbits(6) | rng.getrandbits(6) for _ in range(size)]
        for n in (1, 2, 3, 7, 16, 50):
            out = _window_ands(present, n)
            for k in range(size + 1):
                expected = -1
                for value in present[max(0, k - n) : k]:
                    expected &= value
                assert out[k] == expected, (size, n, k)


def test_a_meta_of_before_classes_loads_as_full_attention_only() -> None:
    """A source indexed by an older indexer: its meta has no classes, align or untracked
    fields. It loads as its full-attention groups, marked legacy (the indexer snapshots
    it again to learn its windows)."""
    old = {
        "groups": "0", "block_size": "16", "hash_block_size": "16", "hash_algo": "xxh3_128",
        "fingerprint": "f", "medium": "GPU",
    }  # fmt: skip
    tracking = Tracking.from_meta(old)
    assert tracking.legacy and tracking.groups == (0,) and tracking.classes == ()
    assert tracking.align == 16 and tracking.exact
    again = Tracking.from_meta(tracking.to_meta())
    assert not again.legacy and again.groups == (0,) and again.align == 16


def test_tracking_puts_each_window_and_block_size_in_a_class_of_its_own() -> None:
    tracking = Tracking.from_groups(
        [
            (0, "sliding_window", 16, 4096), (1, "full_attention", 32, 0),
            (2, "full_attention", 32, 0), (3, "sliding_window", 16, 4096),
            (4, "sliding_window_mla", 16, 128), (5, "mamba", 64, 0),
            (6, "full_attention", 16, 0), (7, "sliding_window", 16, 0),
        ],
        16, "xxh3_128", "",
    )  # fmt: skip
    assert tracking.groups == (1, 2) and tracking.block_size == 32
    assert [(c.window, c.block_size, c.groups) for c in tracking.classes] == [
        (4096, 16, (0, 3)), (128, 16, (4,)), (0, 16, (6,)),
    ]  # fmt: skip
    # Mamba, and a window a server too old to send it did not say, stay out.
    assert tracking.untracked == (5, 7) and not tracking.exact
    assert tracking.align == 64
    assert Tracking.from_meta(tracking.to_meta()) == tracking
