"""A pool's state, saved and loaded (issue 10): ``to_state`` / ``load_state`` / the encoding.

The promise the restart path rests on: a pool loaded from the state of another (through
the bytes, as a snapshot stores them) is that pool. Its ``to_state`` is equal, and every
later call gets the same answer from both: block ids, eviction order, prefix hits, events
and sequence numbers, for every kind of group. Also here: invalidation (the KV data of
the pool is gone) and the RECOMPUTE outcome it leads to.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvsvc.core import (
    AllBlocksCleared,
    HashingContext,
    MultiModalItem,
    PoolKVCache,
    RequestStart,
    RunningColumns,
)
from kvsvc.core.state import StateFormatError, decode_state, encode_state
from kvsvc.errors import KvsvcError, NotFound
from kvsvc.specs import CrossAttentionSpec, KVCacheConfig, SinkFullAttentionSpec
from tests.core.core_factories import (
    chunked_spec,
    full_config,
    full_spec,
    hybrid_config,
    make_config,
    mamba_spec,
)

CONFIGS: dict[str, KVCacheConfig] = {
    "full": full_config(4, 64),
    "hybrid": hybrid_config(4, 96, 2),
    "mamba_align": make_config(80, full_spec(4), mamba_spec(4)),
    "mamba_all": make_config(80, full_spec(4), mamba_spec(4, "all")),
    "chunked": make_config(80, full_spec(4), chunked_spec(4, 8)),
    "sink": make_config(
        64,
        SinkFullAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sink_len=8
        ),
    ),
    "cross": make_config(
        96,
        full_spec(4),
        CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32"),
    ),
}
PREFIXES = ([1] * 40, [2] * 33, list(range(50)))
CONTEXTS = (
    None,
    HashingContext(cache_salt="tenant"),
    HashingContext(lora_name="adapter", lora_path="/a"),
    HashingContext(mm_items=(MultiModalItem("img", 2, 6),)),
    HashingContext(prompt_embeds_digests=(b"d0", b"d1")),
)


def drive(cache: PoolKVCache, rng: random.Random, steps: int) -> list[Any]:
    """A random engine: admissions with shared prefixes and hashing contexts, decodes
    (single and multi-token, the columnar path too), frees, preemptions and re-admissions,
    invalidations. Returns every answer and event, to compare two pools by."""
    log: list[Any] = []
    live = sorted(cache.request_ids())
    for _ in range(steps):
        roll = rng.random()
        try:
            if roll < 0.25 or not live:
                rid = f"r{rng.randrange(10**6)}"
                prompt = rng.choice(PREFIXES) + [
                    rng.randrange(1000) for _ in range(rng.randrange(1, 40))
                ]
                start = RequestStart(
                    hashing=rng.choice(CONTEXTS),
                    resumed=rng.random() < 0.2,
                    num_encoder_tokens=rng.choice((0, 8)),
                )
                outcome = cache.allocate(rid, prompt, rng.randrange(1, 80), start=start)
                log.append(("admit", rid, outcome))
                if outcome.ok:
                    live.append(rid)
            elif roll < 0.35:
                rid = live.pop(rng.randrange(len(live)))
                log.append(("free", rid, cache.free([rid], preempted=rng.random() < 0.5)))
            elif roll < 0.45 and cache.has_plain_tables:
                ids = rng.sample(live, min(len(live), 8))
                out = RunningColumns(len(ids))
                tokens = [rng.randrange(1000) for _ in ids]
                ones = [1] * len(ids)
                cache.allocate_running(ids, tokens, ones, ones, 0, len(ids), 0, out)
                log.append(("run", ids, out.ok, out.num_computed_tokens, out.new_block_ids))
                log.append(("run-flags", sorted(out.errors), out.recompute))
            elif roll < 0.47:
                log.append(("invalidate", cache.invalidate()))
            else:
                rid = rng.choice(live)
                new = [rng.randrange(1000) for _ in range(rng.choice((0, 1, 1, 1, 3)))]
                outcome = cache.allocate(rid, new, rng.choice((1, 1, 2, 5)))
                log.append(("decode", rid, outcome))
                if outcome.recompute:  # the engine follows the status
                    cache.free([rid], preempted=True)
                    live.remove(rid)
        except KvsvcError as exc:
            log.append(("error", type(exc).__name__, str(exc)))
        batch = cache.take_events()
        log.append(("events", None if batch is None else (batch.seq, batch.events)))
    return log


def reload(cache: PoolKVCache, config: KVCacheConfig) -> PoolKVCache:
    """``cache`` through the bytes a snapshot stores, into a new pool."""
    return PoolKVCache.from_state(config, decode_state(encode_state(cache.to_state())))


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor"])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_loaded_pool_is_the_pool_it_was_saved_from(kind: str, algo: str) -> None:
    config = CONFIGS[kind]
    for seed in range(3):
        original = PoolKVCache(config, max_model_len=400, hash_algo=algo, recently_freed=5)
        drive(original, random.Random(seed), 250)
        state = original.to_state()
        assert decode_state(encode_state(state)) == state
        loaded = reload(original, config)
        assert loaded.to_state() == state
        pool, other = original.manager.block_pool, loaded.manager.block_pool
        assert (other._index, other._dups) == (pool._index, pool._dups)
        assert list(other.free_queue) == list(pool.free_queue)
        # The same calls from here on get the same answers, events and sequence numbers.
        assert drive(original, random.Random(seed + 100), 250) == drive(
            loaded, random.Random(seed + 100), 250
        )
        assert loaded.to_state() == original.to_state()


def test_a_decode_step_after_loading_fills_the_same_blocks() -> None:
    """The columnar decode path (a Step's) on a loaded pool: the token arrays it appends
    to are the loaded ones, and the block-completing hash matches the original's."""
    config = full_config(4, 40)
    original = PoolKVCache(config, max_model_len=200)
    for i in range(6):
        assert original.allocate(f"r{i}", [7] * 8 + [i] * (3 + i), 11 + i, start=RequestStart()).ok
    original.take_events()
    loaded = reload(original, config)
    ids = [f"r{i}" for i in range(6)]
    for step in range(9):
        outs = []
        for cache in (original, loaded):
            out = RunningColumns(6)
            cache.allocate_running(ids, [step] * 6, [1] * 6, [1] * 6, 0, 6, 0, out)
            batch = cache.take_events()
            outs.append((out.ok, out.new_block_ids, batch.seq if batch else None))
        assert outs[0] == outs[1]
    assert loaded.to_state() == original.to_state()


def test_the_state_keeps_the_retry_memory() -> None:
    """An admission retried after a restart is answered from the loaded state, and a Free
    retried after a restart of a freed id still succeeds."""
    config = full_config(4, 40)
    original = PoolKVCache(config, max_model_len=200)
    first = original.allocate("a", list(range(20)), 20, start=RequestStart())
    original.allocate("b", list(range(9)), 9, start=RequestStart())
    original.free(["b"])
    original.take_events()
    loaded = reload(original, config)
    again = loaded.allocate("a", list(range(20)), 20, start=RequestStart())
    assert again == first
    assert loaded.free(["b"]) == 0
    with pytest.raises(NotFound):
        loaded.free(["never"])


def test_a_state_is_refused_by_another_pool() -> None:
    config = full_config(4, 40)
    cache = PoolKVCache(config, max_model_len=200, hash_algo="xxh3_128")
    state = cache.to_state()
    with pytest.raises(ValueError, match="num_blocks"):
        PoolKVCache(full_config(4, 41), max_model_len=200).load_state(state)
    with pytest.raises(ValueError, match="seeds differ"):
        PoolKVCache(config, max_model_len=200, hash_seed="other").load_state(state)
    with pytest.raises(ValueError, match="max_model_len"):
        PoolKVCache(config, max_model_len=100, hash_seed=cache.hash_seed).load_state(state)
    with pytest.raises(ValueError, match="version"):
        cache.load_state({**state, "version": 99})


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-3],  # truncated
        lambda data: b"NOTKVSVC" + data[8:],  # another format
        lambda data: data[:7] + b"\x09" + data[8:],  # another encoding version
        lambda data: data[:20] + bytes(40) + data[60:],  # scrambled header
    ],
    ids=["truncated", "magic", "version", "scrambled"],
)
def test_damaged_bytes_are_refused(damage: Any) -> None:
    cache = PoolKVCache(full_config(4, 40), max_model_len=200)
    cache.allocate("a", list(range(30)), 30, start=RequestStart())
    cache.take_events()
    with pytest.raises(StateFormatError):
        decode_state(damage(encode_state(cache.to_state())))


def test_a_state_whose_index_does_not_add_up_is_refused() -> None:
    """Two blocks cached under one hash without the duplicate entry saying which is
    found first: loading it would pick one at random."""
    cache = PoolKVCache(full_config(4, 40), max_model_len=200)
    cache.allocate("a", list(range(30)), 30, start=RequestStart())
    cache.take_events()
    state = cache.to_state()
    block_pool = state["manager"]["block_pool"]
    hashes = block_pool["block_hash"]
    cached = [b for b, h in enumerate(hashes) if h is not None]
    hashes[cached[1]] = hashes[cached[0]]
    with pytest.raises(ValueError, match="several blocks"):
        PoolKVCache.from_state(full_config(4, 40), state)


def test_invalidate_drops_every_hash_and_flags_the_live_requests() -> None:
    cache = PoolKVCache(full_config(4, 40), max_model_len=200)
    assert cache.allocate("a", list(range(30)), 30, start=RequestStart()).ok
    assert cache.allocate("b", list(range(30)), 30, start=RequestStart()).num_cached_tokens == 28
    cache.take_events()
    held = cache.block_table("a").groups
    free_before = cache.usage().num_free_blocks
    assert cache.invalidate() == (2, 7)
    batch = cache.take_events()
    assert batch is not None and batch.events == [AllBlocksCleared()]
    usage = cache.usage()
    assert usage.num_cached_blocks == 0 and usage.num_free_blocks == free_before
    assert cache.lookup(list(range(30))) == 0  # no stale hit
    # Every call of a flagged request answers RECOMPUTE and changes nothing.
    for outcome in (
        cache.allocate("a", [1], 1),
        cache.allocate("a", list(range(30)), 30, start=RequestStart()),
    ):
        assert (outcome.ok, outcome.recompute, outcome.num_computed_tokens) == (False, True, 30)
    out = RunningColumns(1)
    cache.allocate_running(["b"], [5], [1], [1], 0, 1, 0, out)
    assert out.recompute == [0] and out.ok == [False]
    assert cache.block_table("a").groups == held and cache.block_table("a").needs_recompute
    assert cache.take_events() is None
    # The engine frees it (its blocks go back uncached) and admits it again: recomputed.
    assert cache.free(["a"], preempted=True) == 1
    again = cache.allocate("a", list(range(31)), 31, start=RequestStart(resumed=True))
    assert again.ok and again.num_cached_tokens == 0 and not cache.needs_recompute("a")
    assert cache.needs_recompute("b")
