"""PoolKVCache: the engine-facing facade (DESIGN.md's Allocate table), errors and NO_SPACE."""

from __future__ import annotations

from typing import Any

import pytest
from core_factories import (
    check_pool_invariants,
    free_order,
    full_config,
    full_spec,
    make_config,
    mamba_spec,
    sliding_spec,
)

from kvsvc.core import (
    BlockRemoved,
    BlockStored,
    HashingContext,
    PoolKVCache,
    RequestStart,
)
from kvsvc.errors import InvalidArgument, NotFound

START = RequestStart()


def make_pool(num_blocks: int = 11, block_size: int = 4, **kwargs: Any) -> PoolKVCache:
    kwargs.setdefault("max_model_len", 64)
    kwargs.setdefault("hash_algo", "sha256_cbor")
    return PoolKVCache(full_config(block_size, num_blocks), **kwargs)


def snapshot(pool: PoolKVCache) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    blocks = pool.manager.block_pool
    requests = {
        rid: (
            pool.block_table(rid),
            list(pool.manager.coordinator.managers[0].num_cached_block.items()),
            len(pool._requests[rid].block_hashes),
        )
        for rid in pool.request_ids()
    }
    return (
        free_order(blocks),
        list(blocks.ref_cnt),
        list(blocks.block_hash),
        requests,
        pool.usage(),
        len(pool.manager.events.pending) if pool.manager.events else 0,
    )


def tables(pool: PoolKVCache) -> list[list[int]]:
    return [t for rid in pool.request_ids() for t in pool.block_table(rid).groups]


def test_admission_continuation_decode_and_free() -> None:
    pool = make_pool()
    prompt = list(range(10))
    # Admit with a budget of 6: a chunked prefill.
    out = pool.allocate("a", prompt, 6, start=START)
    assert out.ok and out.new_block_ids == ([1, 2],)
    assert (out.num_cached_tokens, out.num_scheduled_tokens, out.num_computed_tokens) == (0, 6, 6)
    assert out.num_null_blocks == (0,)
    assert pool.has_request("a")
    # The next chunk: the rest of the prompt.
    out = pool.allocate("a", [], 4)
    assert out.ok and out.new_block_ids == ([3],) and out.num_computed_tokens == 10
    # Decode: the sampled token fits in block 3.
    out = pool.allocate("a", [50], 1)
    assert out.ok and out.new_block_ids == ([],) and out.num_computed_tokens == 11
    out = pool.allocate("a", [51], 1)
    assert out.ok and out.new_block_ids == ([],)
    # Crossing a block boundary allocates one block.
    out = pool.allocate("a", [52], 1)
    assert out.ok and out.new_block_ids == ([4],) and out.num_computed_tokens == 13
    view = pool.block_table("a")
    assert view.groups == ([1, 2, 3, 4],)
    assert (view.num_computed_tokens, view.num_tokens) == (13, 13)
    # Tokens 0..11 are known and computed: three blocks cached.
    assert pool.usage().num_cached_blocks == 3
    assert pool.free(["a"]) == 4
    assert not pool.has_request("a")
    assert free_order(pool.manager.block_pool) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]


def test_admission_hit_is_capped_to_recompute_the_last_token() -> None:
    pool = make_pool()
    prompt = list(range(12))
    assert pool.allocate("a", prompt, 12, start=START).ok
    pool.free(["a"])
    # All 12 tokens are cached, but the last one must be computed: a 2-block hit.
    assert pool.lookup(prompt) == 8
    out = pool.allocate("b", prompt, 100, start=START)
    assert out.ok
    assert (out.num_cached_tokens, out.num_scheduled_tokens, out.num_computed_tokens) == (8, 4, 12)
    # The first call reports the whole table: the hits, then the recomputed block, a fresh
    # one; block 3 stays cached (both hold its hash now).
    assert out.new_block_ids == ([1, 2, 4],)
    assert pool.block_table("b").groups == ([1, 2, 4],)
    assert pool.manager.block_pool.cached_blocks_of(pool._requests["b"].block_hashes[2], 0) == [
        3,
        4,
    ]
    usage = pool.usage()
    assert (usage.requests, usage.queries, usage.hits) == (2, 24, 8)


def test_first_call_no_space_leaves_no_trace() -> None:
    pool = make_pool(num_blocks=6, enable_events=True)
    prompt = list(range(12))
    assert pool.allocate("a", prompt, 12, start=START).ok
    pool.free(["a"])
    assert pool.allocate("b", [99] * 4, 4, start=START).ok  # takes the one fresh block
    pool.take_events()
    before = snapshot(pool)
    # Hits blocks 1 and 2 (free, cached) and needs 3 more: 2 + 3 > 4 free.
    out = pool.allocate("c", [*prompt, 1, 2, 3, 4, 5, 6, 7, 8], 20, start=START)
    assert not out.ok
    assert out.new_block_ids == ([],)
    assert (out.num_cached_tokens, out.num_scheduled_tokens, out.num_computed_tokens) == (12, 8, 0)
    assert not pool.has_request("c")
    assert snapshot(pool) == before
    assert pool.take_events() is None


def test_later_call_no_space_drops_the_new_tokens() -> None:
    pool = make_pool(num_blocks=5)
    assert pool.allocate("a", list(range(8)), 8, start=START).ok
    assert pool.allocate("b", list(range(100, 104)), 4, start=START).ok
    before = snapshot(pool)
    out = pool.allocate("a", [7, 7, 7, 7, 7], 5)
    assert not out.ok and out.num_computed_tokens == 8
    assert snapshot(pool) == before
    assert pool.block_table("a").num_tokens == 8
    # Once there is room, the same call succeeds and hashes the completed block.
    pool.free(["b"])
    out = pool.allocate("a", [7, 7, 7, 7, 7], 5)
    assert out.ok and out.new_block_ids == ([4, 3],)
    assert pool.block_table("a").num_tokens == 13
    # a's three full blocks; b's cached block was reused (evicted).
    assert pool.usage().num_cached_blocks == 3 and pool.usage().num_evictions == 1


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda p: p.allocate("x", [1], -1, start=START), "num_new_tokens"),
        (lambda p: p.allocate("x", [1], 1, -1, start=START), "num_lookahead_tokens"),
        (lambda p: p.allocate("x", [], 1, start=START), "new_token_ids"),
        (lambda p: p.allocate("x", [1, -2], 1, start=START), "new_token_ids"),
        (lambda p: p.allocate("x", [2**31], 1, start=START), "new_token_ids"),
        (lambda p: p.allocate("x", [1.5], 1, start=START), "new_token_ids"),
        (lambda p: p.allocate("x", [1] * 65, 1, start=START), "new_token_ids"),
        (
            lambda p: p.allocate("x", [1], 1, start=RequestStart(num_encoder_tokens=-1)),
            "start.num_encoder_tokens",
        ),
        (lambda p: p.allocate("a", [1, -1], 1), "new_token_ids"),
        (lambda p: p.allocate("a", ["7"], 1), "new_token_ids"),
        (lambda p: p.allocate("a", [1] * 60, 1), "new_token_ids"),
        (lambda p: p.allocate("a", [], 60), "num_new_tokens"),
        (lambda p: p.allocate("a", [1], 1, num_rejected_tokens=6), "num_rejected_tokens"),
        (lambda p: p.free(["a", "a"]), "request_ids"),
        (lambda p: p.evict_blocks([1, 11]), "block_ids"),
        (lambda p: p.evict_blocks([-1]), "block_ids"),
        (lambda p: p.lookup([1, -1]), "token_ids"),
    ],
)
def test_bad_input_names_the_field_and_changes_nothing(call: Any, field: str) -> None:
    pool = make_pool(enable_events=True)
    assert pool.allocate("a", list(range(5)), 5, start=START).ok
    before = snapshot(pool)
    with pytest.raises(InvalidArgument) as err:
        call(pool)
    assert err.value.field == field
    assert snapshot(pool) == before


def test_unknown_requests_are_not_found_and_nothing_is_freed() -> None:
    pool = make_pool()
    assert pool.allocate("a", list(range(5)), 5, start=START).ok
    before = snapshot(pool)
    with pytest.raises(NotFound):
        pool.allocate("missing", [1], 1)
    with pytest.raises(NotFound):
        pool.free(["a", "missing"])
    with pytest.raises(NotFound):
        pool.block_table("missing")
    assert snapshot(pool) == before
    assert pool.has_request("a")


def test_lookup_touches_nothing_and_counts_nothing() -> None:
    pool = make_pool()
    salted = HashingContext(cache_salt="t1")
    assert pool.allocate("a", list(range(13)), 13, start=RequestStart(hashing=salted)).ok
    pool.free(["a"])
    before = snapshot(pool)
    assert pool.lookup(list(range(13)), salted) == 12
    assert pool.lookup(list(range(13))) == 0
    assert pool.lookup(list(range(9)), salted) == 8
    assert pool.lookup([]) == 0 and pool.lookup([0]) == 0
    assert snapshot(pool) == before
    assert make_pool(enable_caching=False).lookup(list(range(13))) == 0


def test_resumption_counts_apart_and_preemption_is_counted() -> None:
    pool = make_pool()
    prompt = list(range(9))
    assert pool.allocate("a", prompt, 9, start=START).ok
    assert pool.allocate("a", [40], 1).ok
    assert pool.free(["a"], preempted=True) == 3
    # Resume with prompt + outputs: its own blocks are a hit.
    out = pool.allocate("a", [*prompt, 40], 10, start=RequestStart(resumed=True))
    assert out.ok and out.num_cached_tokens == 8
    usage = pool.usage()
    assert (usage.requests, usage.queries, usage.hits) == (1, 9, 0)
    assert (usage.preempted_requests, usage.preempted_queries, usage.preempted_hits) == (1, 10, 8)
    assert usage.num_preemptions == 1


def test_usage_snapshot_counts_blocks_and_requests() -> None:
    pool = make_pool()
    assert pool.num_blocks == 10
    assert pool.allocate("a", list(range(8)), 8, start=START).ok
    assert pool.allocate("b", list(range(8)), 8, start=START).ok  # hits one block
    usage = pool.usage()
    assert usage.num_blocks == 10 and usage.num_requests == 2
    assert usage.num_free_blocks == 7 and usage.usage == pytest.approx(0.3)
    assert usage.num_allocated_blocks == 3  # the hit block was touched, not allocated
    assert usage.num_cached_blocks == 3  # a's two blocks, b's second block
    pool.free(["a", "b"])
    usage = pool.usage()
    assert usage.num_freed_blocks == 3 and usage.num_free_blocks == 10
    assert usage.num_evictions == 0
    assert pool.allocate("c", [5] * 40, 40, start=START).ok
    assert pool.usage().num_evictions == 3


def test_events_are_batched_with_increasing_sequence_numbers() -> None:
    pool = make_pool(num_blocks=4, enable_events=True)
    assert pool.take_events() is None
    assert pool.allocate("a", list(range(8)), 8, start=START).ok
    first = pool.take_events()
    assert first is not None and first.seq == 1 and first.timestamp > 0
    assert [type(e) for e in first.events] == [BlockStored]
    pool.free(["a"])
    assert pool.take_events() is None  # freeing keeps blocks cached: no index change
    assert pool.allocate("b", [9] * 12, 12, start=START).ok
    second = pool.take_events()
    assert second is not None and second.seq == 2
    assert [type(e) for e in second.events] == [BlockRemoved, BlockStored]
    assert make_pool(enable_events=False).take_events() is None


def test_evict_blocks_drops_hits_and_keeps_holders() -> None:
    pool = make_pool()
    assert pool.allocate("a", list(range(9)), 9, start=START).ok
    assert pool.lookup(list(range(9))) == 8
    pool.evict_blocks([2, 0])
    assert pool.lookup(list(range(9))) == 4
    assert pool.block_table("a").groups == ([1, 2, 3],)
    check_pool_invariants(pool.manager.block_pool, tables(pool))


def test_reset_prefix_cache_waits_for_all_requests() -> None:
    pool = make_pool()
    assert pool.allocate("a", list(range(9)), 9, start=START).ok
    assert not pool.reset_prefix_cache()
    pool.free(["a"])
    assert pool.reset_prefix_cache()
    assert pool.lookup(list(range(9))) == 0


def test_hash_configuration() -> None:
    xxh = make_pool(hash_algo="xxh3_128")
    assert xxh.hash_algo == "xxh3_128" and len(xxh.hash_seed) == 64
    assert make_pool(hash_algo="xxh3_128").hash_seed != xxh.hash_seed
    assert make_pool(hash_algo="xxh3_128", hash_seed="s").hash_seed == "s"
    assert make_pool(hash_algo="sha256_cbor").hash_seed == "vllm-none-hash"
    with pytest.raises(ValueError, match="valid: xxh3_128, sha256_cbor"):
        make_pool(hash_algo="sha1")
    with pytest.raises(ValueError, match="max_model_len"):
        make_pool(max_model_len=0)


def test_speculative_tokens_and_rejections() -> None:
    pool = make_pool(hash_algo="xxh3_128")
    assert pool.allocate("a", list(range(7)), 7, start=START).ok
    # Sampled token 70 plus 3 drafts computed this step, 2 lookahead slots.
    out = pool.allocate("a", [70], 4, 2)
    assert out.ok and out.num_computed_tokens == 11 and out.new_block_ids == ([3, 4],)
    # Two drafts were rejected; one accepted plus a bonus token arrive.
    out = pool.allocate("a", [71, 72], 1, num_rejected_tokens=2)
    assert out.ok and out.num_computed_tokens == 10
    view = pool.block_table("a")
    assert (view.num_tokens, view.num_computed_tokens) == (10, 10)
    # Only known tokens were cached: blocks 1 and 2 (tokens 0..7).
    assert pool.usage().num_cached_blocks == 2


def test_zero_budget_admission_holds_the_hit() -> None:
    pool = make_pool()
    assert pool.allocate("a", list(range(9)), 9, start=START).ok
    out = pool.allocate("b", list(range(9)), 0, start=START)
    assert out.ok and out.new_block_ids == ([1, 2],)
    assert (out.num_cached_tokens, out.num_scheduled_tokens, out.num_computed_tokens) == (8, 0, 8)
    assert pool.block_table("b").groups == ([1, 2],)
    out = pool.allocate("c", [500, 501], 0, start=START)
    assert out.ok and out.num_computed_tokens == 0 and pool.block_table("c").groups == ([],)


def test_sliding_window_reports_leading_null_blocks() -> None:
    pool = PoolKVCache(
        make_config(30, full_spec(4), sliding_spec(4, 8)), max_model_len=64, hash_algo="xxh3_128"
    )
    assert pool.group_kinds == ["full_attention", "sliding_window"]
    assert (pool.num_groups, pool.block_size, pool.hash_block_size) == (2, 4, 4)
    out = pool.allocate("a", list(range(10)), 10, start=START)
    assert out.ok and out.new_block_ids == ([1, 2, 3], [4, 5, 6])
    assert out.num_null_blocks == (0, 0)
    # 10 computed: the next token (index 10) still sees token 3, in block 0.
    out = pool.allocate("a", [1], 1)
    assert out.ok and out.num_null_blocks == (0, 0)
    # 11 computed: the next token sees tokens 4..11, so block 0 goes.
    out = pool.allocate("a", [1], 1)
    assert out.ok and out.num_null_blocks == (0, 1) and out.new_block_ids == ([], [])
    assert pool.block_table("a").groups == ([1, 2, 3], [0, 5, 6])
    # The dropped block was cached: it waits at the back of the queue.
    assert free_order(pool.manager.block_pool)[-1] == 4
    out = pool.allocate("a", [1], 1)
    assert out.ok and out.num_null_blocks == (0, 1) and out.new_block_ids == ([7], [8])
    assert pool.block_table("a").groups == ([1, 2, 3, 7], [0, 5, 6, 8])
    check_pool_invariants(pool.manager.block_pool, tables(pool))


def test_mamba_align_pool_reports_nulls_in_new_entries() -> None:
    pool = PoolKVCache(make_config(30, full_spec(4), mamba_spec(4, "align")), max_model_len=64)
    out = pool.allocate("a", list(range(12)), 12, start=START)
    assert out.ok and out.new_block_ids == ([1, 2, 3], [0, 0, 4])
    assert out.num_null_blocks == (0, 2)


def test_encoder_tokens_size_cross_attention_on_admission() -> None:
    from kvsvc.specs import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    pool = PoolKVCache(make_config(20, full_spec(4), cross), max_model_len=64)
    assert not pool.enable_caching
    out = pool.allocate("a", [1, 2, 3], 3, start=RequestStart(num_encoder_tokens=9))
    assert out.ok and out.new_block_ids == ([1], [2, 3, 4])


def test_first_call_reports_the_whole_table_with_hits_and_null_padding() -> None:
    pool = PoolKVCache(
        make_config(30, full_spec(4), sliding_spec(4, 8)), max_model_len=64, hash_algo="xxh3_128"
    )
    prompt = list(range(12))
    out = pool.allocate("a", [*prompt, 50], 13, start=START)
    assert out.ok and out.new_block_ids == ([1, 2, 3, 4], [5, 6, 7, 8])
    # A 12-token hit: full attention needs all three blocks, the window only the last two.
    out = pool.allocate("b", [*prompt, 90, 91], 14, start=START)
    assert out.ok and out.num_cached_tokens == 12
    assert out.new_block_ids == ([1, 2, 3, 9], [0, 6, 7, 10])
    assert out.num_null_blocks == (0, 1)
    assert pool.block_table("b").groups == out.new_block_ids
    # Later calls report only what they append.
    out = pool.allocate("b", [92, 93, 94], 3)
    assert out.ok and out.new_block_ids == ([11], [12])
