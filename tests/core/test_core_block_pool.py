"""BlockPool: reference counts, eviction order, the prefix index and its events."""

from __future__ import annotations

import itertools
import random
from array import array

import pytest
from core_factories import check_pool_invariants, free_order

from kvsvc.core import (
    NULL_BLOCK_ID,
    AllBlocksCleared,
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVEventQueue,
)
from kvsvc.core.block_pool import shard_count


def cache(pool: BlockPool, blocks: list[int], hashes: list[bytes], group_id: int = 0) -> None:
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks), group_id, 4)


def test_new_pool_hands_out_blocks_by_id_and_never_the_null_block() -> None:
    pool = BlockPool(5)
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    assert pool.get_new_blocks(4) == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="cannot pop 1"):
        pool.get_new_blocks(1)
    check_pool_invariants(pool, [[1, 2, 3, 4]])


def test_fresh_blocks_are_reused_first_and_cached_tails_are_evicted_first() -> None:
    pool = BlockPool(11)
    blocks = pool.get_new_blocks(4)
    cache(pool, blocks[:3], [b"h0", b"h1", b"h2"])
    # A request frees its table tail first: 4 (no hash) then 3, 2, 1 (cached).
    pool.free_blocks(reversed(blocks))
    assert free_order(pool) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert pool.num_freed_blocks == 4
    # Lazy eviction: the cached blocks stay findable while free.
    assert pool.get_cached_block(b"h0", [0]) == [1]
    assert pool.get_new_blocks(8) == [4, 5, 6, 7, 8, 9, 10, 3]
    # Block 3 was reused: its hash is gone, the others remain.
    assert pool.get_cached_block(b"h2", [0]) is None
    assert pool.get_cached_block(b"h1", [0]) == [2]
    assert pool.num_evictions == 1


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [b"a", b"b"])
    pool.free_blocks(reversed(blocks))
    assert free_order(pool) == [3, 4, 5, 2, 1]
    pool.touch([1, 2])
    assert pool.ref_cnt[1] == pool.ref_cnt[2] == 1
    assert free_order(pool) == [3, 4, 5]
    pool.touch([1])  # a second holder: no queue change
    assert pool.ref_cnt[1] == 2
    pool.free_blocks([1])
    assert free_order(pool) == [3, 4, 5]
    check_pool_invariants(pool, [[1, 2]])


def test_null_block_entries_are_ignored_by_touch_and_free() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.touch([NULL_BLOCK_ID])
    pool.free_blocks([NULL_BLOCK_ID, blocks[0], NULL_BLOCK_ID])
    assert NULL_BLOCK_ID not in free_order(pool)
    assert free_order(pool) == [1, 2, 3]
    check_pool_invariants(pool, [])


def test_duplicate_hashes_keep_the_earliest_and_survive_partial_eviction() -> None:
    pool = BlockPool(6)
    pool.get_new_blocks(5)
    pool.cache_full_blocks([1], [b"x"], 0, 1, 0, 4)
    pool.cache_full_blocks([2], [b"y"], 0, 1, 0, 4)
    pool.cache_full_blocks([3], [b"z"], 0, 1, 0, 4)
    pool.cache_full_blocks([4], [b"x"], 0, 1, 0, 4)
    assert pool.cached_blocks_of(b"x", 0) == [1, 4]
    pool.evict_blocks([2])
    assert pool.get_cached_block(b"y", [0]) is None
    pool.evict_blocks([1])
    # The duplicate takes over the hash.
    assert pool.get_cached_block(b"x", [0]) == [4]
    pool.evict_blocks([3, 4])
    assert pool.num_cached_blocks == 0
    assert pool.cached_index(0) == {}
    # Evicting blocks without a hash (and the null block) is a no-op.
    pool.evict_blocks([NULL_BLOCK_ID, 5])
    check_pool_invariants(pool, [[1, 2, 3, 4, 5]])


def test_cache_full_blocks_per_group_and_multi_group_lookup() -> None:
    # The reference's multi-group scenario: hashes 0 and 1 cached for groups 0 and 1,
    # hash 2 for group 1 only.
    hasher = BlockHasher("sha256_cbor", 4)
    hashes = hasher.hash_blocks(list(range(14)), 0, 3, None)
    pool = BlockPool(10, num_groups=2)
    pool.cache_full_blocks(pool.get_new_blocks(2), hashes, 0, 2, 0, 4)
    pool.cache_full_blocks(pool.get_new_blocks(3), hashes, 0, 3, 1, 4)
    assert pool.num_cached_blocks == 5
    assert pool.get_cached_block(hashes[0], [0]) == [1]
    assert pool.get_cached_block(hashes[2], [0]) is None
    assert pool.get_cached_block(hashes[2], [1]) == [5]
    assert pool.get_cached_block(hashes[1], [0, 1]) == [2, 4]
    assert pool.get_cached_block(hashes[2], [0, 1]) is None


def test_cache_full_blocks_skips_null_entries_and_prior_hits() -> None:
    pool = BlockPool(8)
    ids = pool.get_new_blocks(3)
    table = [NULL_BLOCK_ID, ids[0], ids[1], ids[2]]
    pool.cache_full_blocks(table, [b"a", b"b", b"c", b"d"], 0, 2, 0, 4)
    assert pool.block_hash[ids[0]] == b"b"
    # Caching the same range again (a hit block) changes nothing.
    pool.cache_full_blocks(table, [b"a", b"b", b"c", b"d"], 1, 4, 0, 4)
    assert pool.num_cached_blocks == 3
    assert pool.block_hash[NULL_BLOCK_ID] is None


def test_reset_is_refused_while_blocks_are_held() -> None:
    events = KVEventQueue()
    pool = BlockPool(6, events=events)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [b"a", b"b"])
    events.take()
    assert not pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 2
    assert events.take() is None
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(b"a", [0]) is None
    assert all(h is None for h in pool.block_hash)
    batch = events.take()
    assert batch is not None and batch.events == [AllBlocksCleared()]
    # Order is untouched; the formerly cached blocks are simply unhashed now.
    assert free_order(pool) == [3, 4, 5, 2, 1]
    check_pool_invariants(pool, [])


def test_reserved_blocks_do_not_block_a_reset() -> None:
    pool = BlockPool(6)
    sink = pool.reserve_blocks(2)
    assert pool.reset_prefix_cache()
    check_pool_invariants(pool, [], reserved=sink)


@pytest.mark.parametrize("group_id", [0, 1, 2])
def test_events_carry_the_group(group_id: int) -> None:
    events = KVEventQueue()
    pool = BlockPool(
        5, num_groups=3, group_kinds=["full_attention", "sliding_window", "mamba"], events=events
    )
    blocks = pool.get_new_blocks(4)
    tokens = list(range(8))
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2, group_id, 4, tokens, "lora-a")
    batch = events.take()
    assert batch is not None and batch.seq == 1
    assert batch.events == [
        BlockStored(
            block_hashes=[b"h0", b"h1"],
            parent_block_hash=None,
            token_ids=array("I", tokens),  # one array, not an int object a token
            block_size=4,
            lora_name="lora-a",
            medium="GPU",
            group_index=group_id,
            group_kind=["full_attention", "sliding_window", "mamba"][group_id],
        )
    ]
    # Re-allocating every block evicts the two cached ones: one removal for the group.
    pool.free_blocks(blocks)
    pool.get_new_blocks(4)
    batch = events.take()
    assert batch is not None and batch.seq == 2
    assert batch.events == [
        BlockRemoved(block_hashes=[b"h0", b"h1"], medium="GPU", group_index=group_id)
    ]
    assert events.take() is None


def test_stored_event_parent_is_the_logical_parent_behind_a_null_block() -> None:
    # The reference's null-parent scenario: block size 1, blocks 2..3 cached behind a null
    # entry at index 1; the parent is still the request's hash of block 1.
    events = KVEventQueue()
    pool = BlockPool(8, events=events)
    hashes = BlockHasher("sha256_cbor", 1).hash_blocks([10, 11, 12, 13], 0, 4, None)
    new = pool.get_new_blocks(3)
    table = [new[0], NULL_BLOCK_ID, new[1], new[2]]
    pool.cache_full_blocks(table, hashes, 2, 4, 0, 1, [10, 11, 12, 13])
    batch = events.take()
    assert batch is not None and len(batch.events) == 1
    event = batch.events[0]
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == hashes[1]
    assert event.block_hashes == hashes[2:4]
    assert list(event.token_ids) == [12, 13]
    assert pool.block_hash[NULL_BLOCK_ID] is None


def test_a_caching_step_is_one_event_as_vllm_words_it() -> None:
    """vLLM 0.32's cache_full_blocks: one event per step, the hashes of the blocks it
    cached (none for a skipped null block), the parent of the step's first block and the
    tokens of the whole range; a step that cached nothing is still reported."""
    events = KVEventQueue()
    pool = BlockPool(8, events=events)
    new = pool.get_new_blocks(3)
    table = [new[0], NULL_BLOCK_ID, new[1], new[2], NULL_BLOCK_ID]
    hashes = [b"a", b"b", b"c", b"d", b"e"]
    pool.cache_full_blocks(table, hashes, 0, 4, 0, 2, list(range(10)))
    pool.cache_full_blocks(table, hashes, 4, 5, 0, 2, list(range(10)))  # a null block
    batch = events.take()
    assert batch is not None
    stored = [(e.block_hashes, e.parent_block_hash, list(e.token_ids)) for e in batch.events]  # type: ignore[union-attr]
    assert stored == [([b"a", b"c", b"d"], None, list(range(8))), ([], b"d", [8, 9])]


def test_a_drain_past_the_batch_bound_splits_into_chained_consecutive_batches() -> None:
    """take_batches keeps each batch within its byte bound: a run of blocks too large for
    one is split into runs whose parents chain, removals into smaller runs, in order, with
    consecutive sequence numbers and nothing lost."""
    from kvsvc.core.events import BlockRemoved, BlockStored, KVEventQueue, wire_bound

    queue = KVEventQueue()
    hashes = [i.to_bytes(16, "big") for i in range(1, 1001)]
    queue.append(
        BlockStored(hashes, b"p" * 16, list(range(16_000)), 16, "lora", "GPU", 0, "full_attention")
    )
    queue.append(BlockRemoved(hashes[:500], "GPU", 0))
    batches = queue.take_batches(max_bytes=8192)
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1)) and len(batches) > 10
    events = [e for b in batches for e in b.events]
    assert all(sum(map(wire_bound, b.events)) <= 8192 for b in batches)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hashes
    assert [t for e in stored for t in e.token_ids] == list(range(16_000))
    assert stored[0].parent_block_hash == b"p" * 16
    for before, after in itertools.pairwise(stored):
        assert after.parent_block_hash == before.block_hashes[-1]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == hashes[:500]
    # Below the bound: one batch, as take() makes it.
    queue.append(BlockRemoved(hashes[:2], "GPU", 0))
    (single,) = queue.take_batches()
    assert single.seq == len(batches) + 1 and len(single.events) == 1
    assert queue.take_batches() == []


def _cycled_pool() -> BlockPool:
    """A pool whose every free block is cached (the LRU region only), with a duplicate
    hash, a block whose hash was dropped while it was free, and two groups."""
    pool = BlockPool(9, num_groups=2, events=KVEventQueue())
    blocks = pool.get_new_blocks(8)
    pool.cache_full_blocks(blocks[:3], [b"a", b"b", b"c"], 0, 3, 0, 4)
    pool.cache_full_blocks(blocks[3:5], [b"d", b"e"], 0, 2, 1, 4)
    pool.cache_full_blocks(blocks[5:6], [b"a"], 0, 1, 0, 4)  # a duplicate of block 1
    pool.cache_full_blocks(blocks[6:8], [b"f", b"g"], 0, 2, 0, 4)
    pool.free_blocks(blocks)
    pool.evict_blocks([blocks[7]])  # free, linked, and without a hash now
    assert pool.events is not None
    pool.events.take()
    return pool


def test_one_new_block_from_a_cycled_pool_is_one_of_get_new_blocks() -> None:
    """get_new_block's own path for a block from the LRU region (a decode step once the
    pool has cycled) leaves the pool, its index and its events as get_new_blocks(1)."""
    one, listed = _cycled_pool(), _cycled_pool()
    taken_one = [one.get_new_block() for _ in range(8)]
    taken_listed = [listed.get_new_blocks(1)[0] for _ in range(8)]
    assert taken_one == taken_listed == [1, 2, 3, 4, 5, 6, 7, 8]
    for pool in (one, listed):
        check_pool_invariants(pool, [taken_one])
        assert pool.num_cached_blocks == 0
        assert pool.cached_index(0) == pool.cached_index(1) == {}
    assert one.num_evictions == listed.num_evictions == 8  # 7 + the one evict_blocks dropped
    assert one.num_allocated_blocks == listed.num_allocated_blocks == 16
    assert one.block_hash == listed.block_hash
    assert one.events is not None and listed.events is not None
    events = one.events.take()
    assert events is not None
    assert events.events == listed.events.pending
    assert [(e.group_index, e.block_hashes) for e in events.events] == [
        (0, [b"a"]),
        (0, [b"b"]),
        (0, [b"c"]),
        (1, [b"d"]),
        (1, [b"e"]),
        (0, [b"a"]),
        (0, [b"f"]),
    ]
    with pytest.raises(ValueError, match="empty free queue"):
        one.get_new_block()


def test_the_earliest_duplicate_takes_over_when_a_cycled_pool_reuses_a_block() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    for block_id in blocks[:3]:
        pool.cache_full_blocks([block_id], [b"a"], 0, 1, 0, 4)
    pool.free_blocks(blocks[:3])
    assert pool.get_new_block() == 1  # block 1 held "a" first; blocks 2 and 3 have it too
    assert pool.get_cached_block(b"a", [0]) == [2]
    assert pool.cached_blocks_of(b"a", 0) == [2, 3]
    assert pool.get_new_block() == 2
    assert pool.cached_blocks_of(b"a", 0) == [3]
    check_pool_invariants(pool, [[1, 2, 4]])


def test_the_index_is_sharded_by_pool_size_and_the_count_is_checked() -> None:
    assert [shard_count(n) for n in (1, 1024, 1025, 81_920, 1 << 20, 1 << 30)] == [
        1,
        1,
        2,
        128,
        256,
        256,
    ]
    assert BlockPool(81_920).shard_mask == 127
    assert BlockPool(9, index_shards=4).shard_mask == 3
    for bad in (0, 3, 512):
        with pytest.raises(ValueError, match="index_shards must be a power of two"):
            BlockPool(9, index_shards=bad)


def _random_operations(pool: BlockPool, seed: int) -> list[object]:
    """A seeded run of what a pool's callers do (admissions that hit and cache, decodes
    taking one block, frees, evictions, a reset, a state round trip); what each one
    returned, for comparing pools that must behave alike."""
    rng = random.Random(seed)
    # Few hashes, so blocks get cached under a hash another block already has.
    hashes = [bytes([rng.randrange(256), i]) for i in range(24)]
    tables: list[list[int]] = []
    seen: list[object] = []
    for _ in range(600):
        op = rng.random()
        free = pool.get_num_free_blocks()
        if op < 0.35 and free:
            group_id = rng.randrange(pool.num_groups)
            wanted = rng.sample(hashes, rng.randint(1, 4))
            hits = [pool.get_cached_block(h, [group_id]) for h in wanted]
            seen.append(hits)
            n = min(len(wanted), free)
            blocks = pool.get_new_blocks(n) if n > 1 else [pool.get_new_block()]
            pool.cache_full_blocks(blocks, wanted, 0, n, group_id, 4)
            tables.append(blocks)
        elif op < 0.6 and tables:
            table = tables.pop(rng.randrange(len(tables)))
            pool.free_blocks(reversed(table))
        elif op < 0.7:
            h = rng.choice(hashes)
            group_id = rng.randrange(pool.num_groups)
            hit = pool.get_cached_block(h, [group_id])
            seen.append(pool.cached_blocks_of(h, group_id))
            if hit is not None:
                pool.touch(hit)
                tables.append(hit)
        elif op < 0.75:
            cached = [b for b in range(1, pool.num_blocks) if pool.block_hash[b] is not None]
            pool.evict_blocks(rng.sample(cached, min(2, len(cached))))
        elif op < 0.77:
            seen.append(pool.reset_prefix_cache())
        elif op < 0.8:
            assert pool.events is not None
            pool.events.take()
            state = pool.to_state()
            pool.load_state(state)
            seen.append(state["dups"])
        seen.append(free_order(pool))
        check_pool_invariants(pool, tables)
    assert pool.events is not None
    seen.append(pool.events.pending)
    seen.append([pool.cached_index(g) for g in range(pool.num_groups)])
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_a_sharded_index_behaves_as_one_dict(seed: int) -> None:
    """Any shard count gives the same lookups, duplicates, evictions, events and state as
    a single dict (the shards only bound how long one dict's regrowth stalls a call)."""
    runs = [
        _random_operations(BlockPool(40, num_groups=2, events=KVEventQueue(), index_shards=n), seed)
        for n in (1, 4, 64)
    ]
    assert runs[0] == runs[1] == runs[2]
