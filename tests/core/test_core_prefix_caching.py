"""KVCacheManager scenarios ported from the reference's prefix-caching tests.

Each test narrates a scheduler sequence and asserts exact block ids, reference counts and
the free queue's eviction order after each step.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import cbor2
import pytest
import xxhash
from core_factories import (
    admit,
    check_pool_invariants,
    free_order,
    full_config,
    full_spec,
    hybrid_config,
    make_config,
    make_manager,
    make_request,
    mamba_spec,
    sliding_spec,
)

from kvsvc.core import (
    NULL_BLOCK_ID,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashingContext,
    KVCacheManager,
    MultiModalItem,
)


def chain(algo: str, seed: str, tokens: list[int], block_size: int, keys: list[Any]) -> list[bytes]:
    """Expected block hashes, computed from the documented formulas only."""
    if algo == "sha256_cbor":

        def digest(obj: Any) -> bytes:
            return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

        parent = digest(seed)
        out = []
        for i in range(len(tokens) // block_size):
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            parent = digest((parent, block, keys[i]))
            out.append(parent)
        return out
    parent = xxhash.xxh3_128_digest(seed.encode())
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        tail = b"" if keys[i] is None else cbor2.dumps(keys[i], canonical=True)
        parent = xxhash.xxh3_128_digest(parent + struct.pack(f"<{block_size}i", *block) + tail)
        out.append(parent)
    return out


def all_tables(manager: KVCacheManager) -> list[list[int]]:
    return [t for m in manager.coordinator.managers for t in m.req_to_blocks.values()]


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128"])
def test_prefill(algo: str) -> None:
    manager = KVCacheManager(full_config(16, 11), 8192, hash_algo=algo, hash_seed="seed")
    pool = manager.block_pool
    common = [i for i in range(3) for _ in range(16)]

    # A complete miss: 3 full blocks and 7 tokens.
    req0 = make_request(manager, "0", common + [3] * 7)
    assert len(req0.block_hashes) == 3
    hits, num_hits, blocks = admit(manager, req0, 55)
    assert hits.get_block_ids() == ([],) and num_hits == 0
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)
    expected = chain(algo, "seed", common, 16, [None] * 3)
    assert [pool.block_hash[b] for b in (1, 2, 3)] == expected
    assert all(pool.block_group[b] == 0 and pool.ref_cnt[b] == 1 for b in (1, 2, 3))
    # The partial block is not cached.
    assert pool.block_hash[4] is None and pool.ref_cnt[4] == 1

    # A hit on the common prefix while its blocks are still in use.
    req1 = make_request(manager, "1", common + [3] * 5)
    hits, num_hits, blocks = admit(manager, req1, 5)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hits == 48
    assert blocks is not None and blocks.get_block_ids() == ([5],)
    assert [pool.ref_cnt[b] for b in (1, 2, 3)] == [2, 2, 2]
    assert pool.get_num_free_blocks() == 5

    manager.free(req0)
    manager.free(req1)
    # Uncached partial blocks first (5, 4), never-used blocks, then the cached chain tail
    # first (3, 2, 1).
    assert free_order(pool) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A hit on the common prefix while its blocks are free.
    req2 = make_request(manager, "2", common + [3] * 6)
    hits, num_hits, blocks = admit(manager, req2, 5)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hits == 48
    assert blocks is not None and blocks.get_block_ids() == ([5],)
    assert free_order(pool) == [4, 6, 7, 8, 9, 10]
    manager.free(req2)
    assert free_order(pool) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A miss that needs every block: the allocation order is the eviction order.
    req3 = make_request(manager, "3", [99] * 160)
    _, num_hits, blocks = admit(manager, req3)
    assert num_hits == 0
    assert blocks is not None and blocks.get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert pool.get_num_free_blocks() == 0 and free_order(pool) == []
    check_pool_invariants(pool, all_tables(manager))


def test_prefill_hybrid_model() -> None:
    manager = make_manager(hybrid_config(16, 21, window_blocks=2))
    pool = manager.block_pool
    common = [i for i in range(3) for _ in range(16)]

    req0 = make_request(manager, "0", common + [3] * 7)
    _, num_hits, blocks = admit(manager, req0, 55)
    assert num_hits == 0
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    for position, block_ids in enumerate(((1, 5, 9), (2, 6, 10), (3, 7, 11))):
        for group_id, block_id in enumerate(block_ids):
            assert pool.block_hash[block_id] == req0.block_hashes[position]
            assert pool.block_group[block_id] == group_id
    assert all(pool.block_hash[b] is None for b in (4, 8, 12))

    # Sliding window 32 tokens: only the last two blocks of the hit are needed.
    req1 = make_request(manager, "1", common + [3] * 5)
    hits, num_hits, blocks = admit(manager, req1, 5)
    assert hits.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
    assert num_hits == 48
    assert blocks is not None and blocks.get_block_ids() == ([13], [14], [15])
    assert all(pool.ref_cnt[b] == 2 for b in (1, 2, 3, 6, 7, 10, 11))
    # The hit's first sliding-window blocks were never touched.
    assert pool.ref_cnt[5] == pool.ref_cnt[9] == 1
    check_pool_invariants(pool, all_tables(manager))


def _hybrid_after_two_requests() -> tuple[KVCacheManager, list[bytes], list[int]]:
    manager = make_manager(hybrid_config(16, 21, window_blocks=2))
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request(manager, "0", common + [3] * 7)
    admit(manager, req0, 55)
    req1 = make_request(manager, "1", common + [3] * 5)
    admit(manager, req1, 5)
    manager.free(req0)
    manager.free(req1)
    return manager, req1.block_hashes, common + [3] * 5


@pytest.mark.parametrize(
    ("evict", "expect_blocks"),
    [
        # Blocks outside the sliding window do not matter.
        ([(0, 1), (0, 2)], 3),
        # The full-attention chain is broken at its first block: total miss.
        ([(0, 0)], 0),
        ([(2, 0), (2, 1), (2, 2)], 2),
        ([(2, 0)], 2),
        # Both sliding-window groups must hit (they are looked up together).
        ([(2, 1)], 2),
        ([(2, 2)], 2),
        # Full attention hits 1 block, sliding window 2: no common length.
        ([(2, 0), (0, 1), (0, 2)], 0),
    ],
)
def test_hybrid_hit_must_hold_for_every_group(
    evict: list[tuple[int, int]], expect_blocks: int
) -> None:
    manager, hashes, prompt = _hybrid_after_two_requests()
    pool = manager.block_pool
    for position, group_id in evict:
        pool.evict_blocks(pool.cached_blocks_of(hashes[position], group_id))
    request = make_request(manager, "probe", prompt)
    hits, num_hits = manager.get_computed_blocks(request)
    assert num_hits == expect_blocks * 16
    assert [len(group) for group in hits.blocks] == [expect_blocks] * 3


@pytest.mark.parametrize(
    "spec_types",
    [
        ["full", "sliding"],
        ["full", "mamba"],
        ["sliding", "mamba"],
        ["sliding", "sliding_large"],
        ["full", "sliding", "mamba"],
        ["full", "full", "sliding"],
        ["full", "sliding", "full", "sliding_large"],
        ["sliding", "mamba", "sliding_large", "mamba"],
        ["full", "full", "sliding", "mamba"],
    ],
)
def test_hybrid_combinations_share_a_three_block_prefix(spec_types: list[str]) -> None:
    specs = {
        "full": full_spec(16),
        "sliding": sliding_spec(16, 32),
        "sliding_large": sliding_spec(16, 64),
        "mamba": mamba_spec(16, "align"),
    }
    manager = make_manager(make_config(10 * len(spec_types), *(specs[t] for t in spec_types)))
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request(manager, "0", common + [3] * 7)
    # Prefill split at the block boundary, as Mamba's align mode requires of the
    # scheduler: the state after 48 tokens is what a later request can hit.
    _, num_hits, blocks = admit(manager, req0, 48)
    assert num_hits == 0 and blocks is not None
    assert manager.allocate_slots(req0, 7) is not None
    req0.num_computed_tokens = 55
    req1 = make_request(manager, "1", common + [4] * 5)
    _hits, num_hits, blocks = admit(manager, req1)
    assert num_hits == 48
    assert blocks is not None and len(blocks.blocks) == len(spec_types)
    check_pool_invariants(manager.block_pool, all_tables(manager))
    manager.free(req0)
    manager.free(req1)
    check_pool_invariants(manager.block_pool, [])


def test_skip_reading_the_cache_still_caches_duplicates() -> None:
    # The reference's prompt-logprobs scenario.
    manager = make_manager(full_config(16, 11))
    pool = manager.block_pool
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request(manager, "0", common + [3] * 7, skip_reading_prefix_cache=True)
    _, num_hits, blocks = admit(manager, req0, 55)
    assert num_hits == 0 and blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)
    req0_hashes = [pool.block_hash[b] for b in (1, 2, 3)]

    req1 = make_request(manager, "1", common + [3] * 5)
    hits, num_hits, blocks = admit(manager, req1, 5)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hits == 48
    manager.free(req0)
    manager.free(req1)
    assert free_order(pool) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Skipping the read: no hit, and the new blocks duplicate the cached hashes.
    req2 = make_request(manager, "2", common + [3] * 6, skip_reading_prefix_cache=True)
    _, num_hits, blocks = admit(manager, req2, 54)
    assert num_hits == 0
    assert blocks is not None and blocks.get_block_ids() == ([5, 4, 6, 7],)
    assert [pool.block_hash[b] for b in (5, 4, 6)] == req0_hashes
    assert all(pool.ref_cnt[b] == 1 for b in (5, 4, 6, 7))
    # The earliest cached copy still answers lookups.
    assert pool.cached_blocks_of(req0_hashes[0], 0) == [1, 5]
    manager.free(req2)
    check_pool_invariants(pool, [])


def test_decode_caches_a_block_once_it_fills() -> None:
    manager = make_manager(full_config(16, 11))
    pool = manager.block_pool
    req0 = make_request(manager, "0", [i for i in range(3) for _ in range(16)] + [3] * 7)
    _, _, blocks = admit(manager, req0, 55)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)

    # Four decode tokens fit in the partial block.
    req0.append_token_ids([8] * 4)
    new = manager.allocate_slots(req0, 4)
    assert new is not None and new.get_block_ids() == ([],)
    assert pool.block_hash[4] is None
    req0.num_computed_tokens = 59

    # 19 more: 9 fill block 4 (now cached), 10 go to a new block.
    req0.append_token_ids([7] * 19)
    assert len(req0.block_hashes) == 4
    new = manager.allocate_slots(req0, 19)
    assert new is not None and new.get_block_ids() == ([5],)
    assert pool.block_hash[4] == req0.block_hashes[3]
    assert pool.block_hash[5] is None
    assert manager.get_block_ids("0") == ([1, 2, 3, 4, 5],)


def test_evict_order_is_lru_with_chain_tails_first() -> None:
    manager = make_manager(full_config(16, 11))
    pool = manager.block_pool
    req0 = make_request(manager, "0", list(range(5 * 16 + 7)))
    _, _, blocks = admit(manager, req0)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4, 5, 6],)
    req1 = make_request(manager, "1", list(range(87, 87 + 3 * 16)))
    _, _, blocks = admit(manager, req1)
    assert blocks is not None and blocks.get_block_ids() == ([7, 8, 9],)
    assert free_order(pool) == [10]

    manager.free(req0)
    # The partial block (no hash) goes first, cached ones last, tail first.
    assert free_order(pool) == [6, 10, 5, 4, 3, 2, 1]
    manager.free(req1)
    assert free_order(pool) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    # Touching the first two blocks takes them out of the queue.
    req2 = make_request(manager, "2", list(range(2 * 16 + 3)))
    hits, num_hits, blocks = admit(manager, req2, 3)
    assert hits.get_block_ids() == ([1, 2],) and num_hits == 32
    assert blocks is not None and blocks.get_block_ids() == ([6],)
    assert free_order(pool) == [10, 5, 4, 3, 9, 8, 7]


def test_reused_block_loses_its_old_hash() -> None:
    manager = make_manager(full_config(16, 2))
    pool = manager.block_pool
    req = make_request(manager, "0", list(range(16)))
    _, _, blocks = admit(manager, req)
    assert blocks is not None and blocks.get_block_ids() == ([1],)
    assert pool.block_hash[1] is not None
    manager.free(req)
    # A 15-token request gets the same block; it must not keep the stale hash.
    req = make_request(manager, "1", list(range(15)))
    _, num_hits, blocks = admit(manager, req)
    assert num_hits == 0 and blocks is not None and blocks.get_block_ids() == ([1],)
    assert pool.block_hash[1] is None
    assert pool.num_cached_blocks == 0


def test_computed_blocks_are_not_evicted_for_the_same_request() -> None:
    manager = make_manager(full_config(16, 3))
    req0 = make_request(manager, "0", list(range(16)))
    assert admit(manager, req0)[2].get_block_ids() == ([1],)  # type: ignore[union-attr]
    req1 = make_request(manager, "1", list(range(16, 32)))
    assert admit(manager, req1)[2].get_block_ids() == ([2],)  # type: ignore[union-attr]
    manager.free(req0)
    manager.free(req1)
    # The hit on block 1 must make the allocation evict block 2, not 1.
    req2 = make_request(manager, "2", list(range(32)))
    hits, num_hits, blocks = admit(manager, req2)
    assert hits.get_block_ids() == ([1],) and num_hits == 16
    assert blocks is not None and blocks.get_block_ids() == ([2],)


def test_caching_disabled() -> None:
    manager = make_manager(full_config(4, 5), enable_caching=False)
    assert manager.hasher is None
    req1 = make_request(manager, "1", list(range(10)))
    assert req1.block_hashes == []
    _, num_hits, blocks = admit(manager, req1)
    assert num_hits == 0 and blocks is not None and blocks.get_block_ids() == ([1, 2, 3],)
    manager.free(req1)
    # The same prefix again: no hit.
    req2 = make_request(manager, "2", list(range(16)))
    hits, num_hits, blocks = admit(manager, req2)
    assert hits.get_block_ids() == ([],) and num_hits == 0
    # Blocks freed without hashes went to the front, in table-tail-first order.
    assert blocks is not None and blocks.get_block_ids() == ([3, 2, 1, 4],)
    # Nothing left for another request.
    req3 = make_request(manager, "3", list(range(4)))
    assert admit(manager, req3)[2] is None
    assert manager.block_pool.num_cached_blocks == 0


def test_multimodal_items_enter_the_hashes_and_hits() -> None:
    manager = make_manager(full_config(16, 11))
    common = list(range(10)) + [0] * 6 + [0] * 4 + list(range(10, 20)) + [0] * 2 + [0] * 16
    items = (
        MultiModalItem("aaa", 11, 10),
        MultiModalItem("bbb", 30, 18),
        MultiModalItem("ccc", 48, 7),
    )
    prompt = common + [0] * 7 + [100] * 4
    req0 = make_request(manager, "0", prompt, hashing=HashingContext(mm_items=items))
    keys = [
        (("mm", "aaa", 11),),
        (("mm", "aaa", -5), ("mm", "bbb", 14)),
        (("mm", "bbb", -2),),
        (("mm", "ccc", 0),),
    ]
    assert req0.block_hashes == chain("sha256_cbor", "vllm-none-hash", prompt, 16, keys[:3])
    _, _, blocks = admit(manager, req0, 59)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3, 4],)

    # Decode tokens complete block 3, whose keys still name the third item.
    req0.append_token_ids([8] * 5)
    assert manager.allocate_slots(req0, 5) is not None
    assert req0.block_hashes == chain("sha256_cbor", "vllm-none-hash", prompt + [8] * 5, 16, keys)

    # Same items: a 3-block hit. Another image in block 1: only block 0 hits.
    same = make_request(
        manager, "1", common + [0] * 7 + [200] * 5, hashing=HashingContext(mm_items=items)
    )
    assert manager.get_computed_blocks(same)[1] == 48
    other_items = (MultiModalItem("aaa", 11, 10), MultiModalItem("zzz", 30, 18))
    other = make_request(
        manager, "2", common + [1] * 9, hashing=HashingContext(mm_items=other_items)
    )
    assert manager.get_computed_blocks(other)[1] == 16


def test_cache_salt_isolates_tenants() -> None:
    manager = make_manager(full_config(16, 11))
    common = [i for i in range(3) for _ in range(16)]
    prompt = common + [3] * 11
    req0 = make_request(manager, "0", prompt, hashing=HashingContext(cache_salt="salt1"))
    keys: list[Any] = [(("cache_salt", "salt1"),), None, None]
    assert req0.block_hashes == chain("sha256_cbor", "vllm-none-hash", prompt, 16, keys)
    admit(manager, req0, 59)
    req0.append_token_ids([8] * 5)
    assert manager.allocate_slots(req0, 5) is not None
    assert req0.block_hashes == chain(
        "sha256_cbor", "vllm-none-hash", prompt + [8] * 5, 16, [*keys, None]
    )

    same_salt = make_request(manager, "1", common + [4] * 11, hashing=HashingContext("salt1"))
    assert manager.get_computed_blocks(same_salt)[1] == 48
    other_salt = make_request(manager, "2", common + [4] * 11, hashing=HashingContext("salt2"))
    assert manager.get_computed_blocks(other_salt)[1] == 0
    no_salt = make_request(manager, "3", common + [4] * 11)
    assert manager.get_computed_blocks(no_salt)[1] == 0


def test_lora_name_and_path_isolate_adapters() -> None:
    manager = make_manager(full_config(4, 20), enable_events=True)
    prompt = list(range(13))
    lora_a = HashingContext(lora_name="a", lora_path="/w/a")
    req0 = make_request(manager, "0", prompt, hashing=lora_a)
    admit(manager, req0)
    batch = manager.take_events()
    assert batch is not None
    stored = batch.events[0]
    assert isinstance(stored, BlockStored) and stored.lora_name == "a"

    def hit(hashing: HashingContext | None) -> int:
        return manager.get_computed_blocks(make_request(manager, "x", prompt, hashing=hashing))[1]

    assert hit(lora_a) == 12
    assert hit(HashingContext(lora_name="a", lora_path="/w/a-v2")) == 0
    assert hit(HashingContext(lora_name="b", lora_path="/w/a")) == 0
    assert hit(None) == 0


def test_not_enough_blocks_with_hits_leaves_everything_untouched() -> None:
    manager = make_manager(full_config(16, 11))
    pool = manager.block_pool
    common = [i for i in range(3) for _ in range(16)]
    # | Common-0 | Common-1 | Common-2 |
    req0 = make_request(manager, "0", common)
    admit(manager, req0, 48)
    table0 = manager.get_block_ids("0")[0]
    # | Common-0 | Common-1 | Common-2 | Req1-3 | Req1-4 | Req1-5 |
    req1 = make_request(manager, "1", common * 2)
    hits, num_hits, _ = admit(manager, req1, 48)
    assert hits.get_block_ids()[0] == table0 and num_hits == 48
    table1 = manager.get_block_ids("1")[0]
    manager.free(req1)
    assert [pool.ref_cnt[b] for b in table1] == [1, 1, 1, 0, 0, 0]
    req2 = make_request(manager, "2", [7] * 32)
    admit(manager, req2, 32)
    assert pool.get_num_free_blocks() == 5

    # Req3 hits six blocks (three of them free) and needs three more: 3 + 3 > 5.
    req3 = make_request(manager, "3", common * 3)
    hits, num_hits = manager.get_computed_blocks(req3)
    assert hits.get_block_ids()[0] == table1 and num_hits == 96
    order = free_order(pool)
    refs = list(pool.ref_cnt)
    assert manager.allocate_slots(req3, 48, num_hits, hits) is None
    assert [pool.ref_cnt[b] for b in table1] == [1, 1, 1, 0, 0, 0]
    assert free_order(pool) == order and pool.ref_cnt == refs
    assert manager.get_block_ids("3") == ([],)
    assert not manager.coordinator.is_running("3")
    check_pool_invariants(pool, all_tables(manager))


def test_reset_prefix_cache_refused_while_in_use() -> None:
    manager = make_manager(full_config(16, 11))
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request(manager, "0", common + [3] * 7)
    assert manager.allocate_slots(req0, 55) is not None
    req1 = make_request(manager, "1", common + [4] * 7)
    _hits, num_hits, blocks = admit(manager, req1, 7)
    assert num_hits == 48 and blocks is not None and blocks.get_block_ids() == ([5],)

    assert not manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 3
    manager.free(req0)
    manager.free(req1)
    assert manager.reset_prefix_cache()
    assert manager.block_pool.num_cached_blocks == 0
    assert manager.get_computed_blocks(make_request(manager, "2", [*common, 3]))[1] == 0


@pytest.mark.parametrize("blocks_to_cache", [2, 3, 10])
def test_events_store_remove_clear(blocks_to_cache: int) -> None:
    manager = make_manager(full_config(16, blocks_to_cache + 1), enable_events=True)
    num_tokens = 16 * blocks_to_cache
    req0 = make_request(manager, "0", list(range(num_tokens)))
    assert manager.allocate_slots(req0, num_tokens) is not None
    batch = manager.take_events()
    assert batch is not None and batch.seq == 1
    (stored,) = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == req0.block_hashes
    assert list(stored.token_ids) == list(range(num_tokens)) and stored.block_size == 16
    assert stored.group_index == 0 and stored.group_kind == "full_attention"
    assert stored.parent_block_hash is None and stored.medium == "GPU"
    assert manager.take_events() is None

    # The same tokens without a lookup: every cached block is evicted and re-stored.
    manager.free(req0)
    req1 = make_request(manager, "1", list(range(num_tokens)))
    assert manager.allocate_slots(req1, num_tokens) is not None
    batch = manager.take_events()
    assert batch is not None and batch.seq == 2
    removed, stored_again = batch.events
    assert isinstance(removed, BlockRemoved) and isinstance(stored_again, BlockStored)
    assert sorted(removed.block_hashes) == sorted(req0.block_hashes)
    assert stored_again.block_hashes == req1.block_hashes

    manager.free(req1)
    assert manager.reset_prefix_cache()
    batch = manager.take_events()
    assert batch is not None and batch.seq == 3 and batch.events == [AllBlocksCleared()]


def test_hybrid_events_name_each_group() -> None:
    manager = make_manager(make_config(10, full_spec(4), sliding_spec(4, 128)), enable_events=True)
    req = make_request(manager, "0", list(range(8)))
    assert manager.allocate_slots(req, 8) is not None
    batch = manager.take_events()
    assert batch is not None
    assert [(e.group_index, e.group_kind) for e in batch.events] == [  # type: ignore[union-attr]
        (0, "full_attention"),
        (1, "sliding_window"),
    ]


def test_different_block_sizes_per_group() -> None:
    # Full attention with 32-token blocks, sliding window (32 tokens) with 16-token blocks;
    # hashes at 16 tokens, read at 32 through the block-size view.
    manager = make_manager(make_config(100, full_spec(32), sliding_spec(16, 32)))
    assert manager.hash_block_size == 16 and manager.block_size == 32
    common = [i for i in range(10) for _ in range(16)]
    req0 = make_request(manager, "0", common)
    hits, num_hits = manager.get_computed_blocks(req0)
    assert num_hits == 0
    blocks = manager.allocate_slots(req0, 7 * 16, num_hits, hits)
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11])

    req1 = make_request(manager, "1", common[: 7 * 16 + 1])
    hits, num_hits = manager.get_computed_blocks(req1)
    assert [len(g) for g in hits.blocks] == [3, 6] and num_hits == 96
    req2 = make_request(manager, "2", common[: 6 * 16 + 1])
    hits, num_hits = manager.get_computed_blocks(req2)
    assert [len(g) for g in hits.blocks] == [3, 6] and num_hits == 96

    # Sliding-window blocks 5 and 6 gone: the window hit drops to 80 tokens, but full
    # attention needs multiples of 32, so the common hit is 64.
    manager.evict_blocks([11, 10])
    hits, num_hits = manager.get_computed_blocks(req1)
    assert [len(g) for g in hits.blocks] == [2, 4] and num_hits == 64


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    manager = make_manager(full_config(4, 11), max_model_len=12)
    pool = manager.block_pool
    req = make_request(manager, "0", list(range(10)))
    blocks = manager.allocate_slots(req, 10, num_lookahead_tokens=6)
    # 16 slots wanted, capped at max_model_len=12: three blocks; two full blocks cached.
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3],)
    assert [pool.block_hash[b] is not None for b in (1, 2, 3)] == [True, True, False]


def test_drafts_get_slots_but_only_known_tokens_are_cached() -> None:
    manager = make_manager(full_config(4, 11))
    pool = manager.block_pool
    req = make_request(manager, "0", list(range(7)))
    admit(manager, req)
    req.append_token_ids([7])  # sampled token: 8 known, 7 computed
    # Compute the sampled token plus 4 drafts, with 2 lookahead slots.
    blocks = manager.allocate_slots(req, 5, num_lookahead_tokens=2)
    assert blocks is not None and blocks.get_block_ids() == ([3, 4],)
    assert [pool.block_hash[b] is not None for b in (1, 2, 3, 4)] == [True, True, False, False]
    # Rejected drafts: fewer tokens next step never shrink the table.
    req.num_computed_tokens = 9
    assert manager.allocate_slots(req, 1).get_block_ids() == ([],)  # type: ignore[union-attr]
    assert manager.get_block_ids("0") == ([1, 2, 3, 4],)


def test_common_prefix_blocks_count_blocks_every_request_holds() -> None:
    manager = make_manager(full_config(4, 20))
    shared = list(range(8))
    reqs = [make_request(manager, str(i), shared + [100 + i] * 5) for i in range(3)]
    for req in reqs:
        admit(manager, req)
    assert manager.get_num_common_prefix_blocks("0") == [2]
    other = make_request(manager, "x", [50] * 9)
    admit(manager, other)
    assert manager.get_num_common_prefix_blocks("0") == [0]


def test_mamba_align_mode_keeps_one_state_per_step() -> None:
    manager = make_manager(make_config(30, full_spec(4), mamba_spec(4, "align")))
    pool = manager.block_pool
    prompt = [i for i in range(3) for _ in range(4)]

    req0 = make_request(manager, "0", prompt)
    hits, num_hits, blocks = admit(manager, req0)
    assert num_hits == 0
    # Mamba keeps the state at the prompt's last block boundary; earlier entries are null.
    assert blocks is not None and blocks.get_block_ids() == ([1, 2, 3], [0, 0, 4])
    assert pool.block_hash[4] == req0.block_hashes[2] and pool.block_group[4] == 1

    # Decode: a new state block for the next boundary.
    req0.append_token_ids([9])
    assert manager.allocate_slots(req0, 1).get_block_ids() == ([5], [6])  # type: ignore[union-attr]
    req0.num_computed_tokens = 13
    req0.append_token_ids([9])
    # Block 4's state is superseded: null in the table, back in the queue, still cached.
    assert manager.allocate_slots(req0, 1).get_block_ids() == ([], [])  # type: ignore[union-attr]
    req0.num_computed_tokens = 14
    assert manager.get_block_ids("0") == ([1, 2, 3, 5], [0, 0, 0, 6])
    assert free_order(pool)[-1] == 4 and pool.ref_cnt[4] == 0

    # Another request with the same 12-token prefix hits the cached state in block 4.
    req1 = make_request(manager, "1", [*prompt, 5, 6, 7, 8])
    hits, num_hits = manager.get_computed_blocks(req1)
    assert hits.get_block_ids() == ([1, 2, 3], [0, 0, 4]) and num_hits == 12
    blocks = manager.allocate_slots(req1, 4, num_hits, hits)
    assert blocks is not None and blocks.get_block_ids() == ([7], [8])
    req1.num_computed_tokens = 16
    assert manager.get_block_ids("1") == ([1, 2, 3, 7], [0, 0, 4, 8])
    assert pool.ref_cnt[4] == 1
    check_pool_invariants(pool, all_tables(manager))

    # Its next step releases the copied-from state (block 4) and adds one block per group.
    req1.append_token_ids([9])
    assert manager.allocate_slots(req1, 1).get_block_ids() == ([9], [10])  # type: ignore[union-attr]
    assert manager.get_block_ids("1") == ([1, 2, 3, 7, 9], [0, 0, 0, 8, 10])
    assert free_order(pool)[-1] == 4
    check_pool_invariants(pool, all_tables(manager))
    manager.free(req0)
    manager.free(req1)
    check_pool_invariants(pool, [])


def test_mamba_without_cache_mode_turns_prefix_caching_off() -> None:
    manager = make_manager(make_config(10, full_spec(4), mamba_spec(4, "none")))
    assert not manager.enable_caching
    req = make_request(manager, "0", list(range(9)))
    _, num_hits, blocks = admit(manager, req)
    # One running state block: the earlier ones are dropped as tokens are computed.
    assert num_hits == 0 and blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3], [4, 5, 6])
    req.append_token_ids([1])
    assert manager.allocate_slots(req, 1) is not None
    assert manager.get_block_ids("0") == ([1, 2, 3], [0, 0, 6])
    check_pool_invariants(manager.block_pool, all_tables(manager))


def test_cross_attention_table_is_sized_by_the_encoder_input() -> None:
    from kvsvc.specs import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    manager = make_manager(make_config(20, full_spec(4), cross))
    assert not manager.enable_caching
    req = make_request(manager, "0", list(range(6)))
    blocks = manager.allocate_slots(req, 6, num_encoder_tokens=10)
    assert blocks is not None and blocks.get_block_ids() == ([1, 2], [3, 4, 5])
    req.num_computed_tokens = 6
    req.append_token_ids([1, 2, 3])
    assert manager.allocate_slots(req, 3).get_block_ids() == ([6], [])  # type: ignore[union-attr]


def test_sink_blocks_are_reserved_for_the_pool() -> None:
    from kvsvc.specs import SinkFullAttentionSpec

    sink = SinkFullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sink_len=8
    )
    manager = make_manager(make_config(10, sink))
    sink_blocks = manager.coordinator.managers[0].sink_blocks  # type: ignore[attr-defined]
    assert sink_blocks == [1, 2]
    req = make_request(manager, "0", list(range(5)))
    assert admit(manager, req)[2].get_block_ids() == ([3, 4],)  # type: ignore[union-attr]
    check_pool_invariants(manager.block_pool, all_tables(manager), reserved=sink_blocks)
    manager.free(req)
    assert manager.reset_prefix_cache()
    with pytest.raises(ValueError, match="sink_len=6"):
        make_manager(
            make_config(
                10,
                SinkFullAttentionSpec(
                    block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sink_len=6
                ),
            )
        )


def test_hash_block_size_must_fit_the_groups() -> None:
    with pytest.raises(ValueError, match="one KV cache group"):
        make_manager(full_config(16, 4), hash_block_size=8)
    with pytest.raises(ValueError, match="must divide"):
        make_manager(make_config(10, full_spec(32), sliding_spec(16, 64)), hash_block_size=32)
    manager = make_manager(make_config(10, full_spec(32), sliding_spec(16, 64)), hash_block_size=8)
    assert manager.hash_block_size == 8


def test_null_block_is_never_handed_out() -> None:
    manager = make_manager(full_config(4, 4))
    req = make_request(manager, "0", list(range(12)))
    blocks = manager.allocate_slots(req, 12)
    assert blocks is not None and NULL_BLOCK_ID not in blocks.get_block_ids()[0]
    assert manager.allocate_slots(make_request(manager, "1", [1]), 1) is None


def test_a_big_pools_prefix_hits_in_every_shard() -> None:
    """A pool of 20,000 blocks splits its index in 32 shards: an admission of a cached
    200-block prompt hits all of it, whichever shard each hash is in, and a reused block's
    old hash stops hitting."""
    manager = KVCacheManager(
        full_config(16, 20_000), 1 << 20, hash_algo="xxh3_128", hash_seed="shards"
    )
    pool = manager.block_pool
    assert pool.shard_mask == 31
    prompt = [i % 30_000 + 1 for i in range(200 * 16)]
    first = make_request(manager, "first", prompt)
    admit(manager, first)
    # (A fixed seed: these hashes are in every shard; a random one may leave one out.)
    assert len({h[-1] & pool.shard_mask for h in first.block_hashes}) == 32
    manager.free(first)
    again = make_request(manager, "again", [*prompt, 7])
    hits, num_hits, _ = admit(manager, again)
    assert num_hits == 200 * 16 and len(hits.get_block_ids()[0]) == 200
    manager.free(again)
    # Take every block: the cached ones are reused, and their hashes leave the index.
    filler = make_request(manager, "filler", [5] * (19_999 * 16))
    admit(manager, filler)
    manager.free(filler)
    probe = make_request(manager, "probe", [*prompt, 7])
    assert manager.get_computed_blocks(probe)[1] == 0
    check_pool_invariants(pool, all_tables(manager))
