"""Factories shared by the kvsvc.core tests (configs, managers, requests, invariants)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvsvc.core import NULL_BLOCK_ID, BlockPool, HashingContext, KVCacheManager, RequestState
from kvsvc.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def full_spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def sliding_spec(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window
    )


def chunked_spec(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype="float32",
        attention_chunk_size=chunk,
    )


def mamba_spec(block_size: int, mode: str = "align", num_speculative_blocks: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((1, 1),),
        dtypes=("float32",),
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
    )


def make_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)],
    )


def full_config(block_size: int, num_blocks: int) -> KVCacheConfig:
    return make_config(num_blocks, full_spec(block_size))


def hybrid_config(block_size: int, num_blocks: int, window_blocks: int) -> KVCacheConfig:
    """The reference's hybrid test model: full attention + two sliding-window groups."""
    sliding = sliding_spec(block_size, window_blocks * block_size)
    return make_config(num_blocks, full_spec(block_size), sliding, sliding)


def make_manager(
    config: KVCacheConfig,
    *,
    hash_algo: str = "sha256_cbor",
    enable_caching: bool = True,
    enable_events: bool = False,
    max_model_len: int = 8192,
    hash_block_size: int | None = None,
) -> KVCacheManager:
    return KVCacheManager(
        config,
        max_model_len,
        enable_caching=enable_caching,
        hash_algo=hash_algo,
        hash_block_size=hash_block_size,
        enable_events=enable_events,
    )


def make_request(
    manager: KVCacheManager,
    request_id: str,
    token_ids: Sequence[int],
    *,
    hashing: HashingContext | None = None,
    skip_reading_prefix_cache: bool = False,
) -> RequestState:
    return manager.new_request(
        request_id,
        list(token_ids),
        hashing=hashing,
        skip_reading_prefix_cache=skip_reading_prefix_cache,
    )


def admit(manager: KVCacheManager, request: RequestState, num_new_tokens: int | None = None):
    """get_computed_blocks + allocate_slots for a new request, as the scheduler does."""
    hits, num_hits = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hits
    blocks = manager.allocate_slots(request, num_new_tokens, num_hits, hits)
    if blocks is not None:
        request.num_computed_tokens = num_hits + num_new_tokens
    return hits, num_hits, blocks


def free_order(pool: BlockPool) -> list[int]:
    return pool.free_queue.get_all_free_blocks()


def check_pool_invariants(
    pool: BlockPool, tables: Sequence[Sequence[int]], reserved: Sequence[int] = ()
) -> None:
    """Every block is free or held (never both, never lost) and ref counts equal holders.

    Args:
        pool: the pool.
        tables: every block table holding blocks (all requests, all groups).
        reserved: blocks held for the pool's lifetime (sink blocks).
    """
    queue = pool.free_queue.get_all_free_blocks()
    assert len(queue) == len(set(queue)), "a block is in the free queue twice"
    assert len(queue) == pool.get_num_free_blocks()
    assert NULL_BLOCK_ID not in queue
    holders = Counter(b for table in tables for b in table if b != NULL_BLOCK_ID)
    holders.update(reserved)
    free = set(queue)
    for block_id in range(1, pool.num_blocks):
        count = pool.ref_cnt[block_id]
        assert count == holders.get(block_id, 0), (
            f"block {block_id}: ref count {count}, holders {holders.get(block_id, 0)}"
        )
        assert (block_id in free) == (count == 0), f"block {block_id} free={block_id in free}"
    # Every indexed hash names a block carrying it, and every cached block is indexed.
    indexed = 0
    for group_id in range(pool.num_groups):
        for block_hash in list(pool.cached_index(group_id)):
            for block_id in pool.cached_blocks_of(block_hash, group_id):
                assert pool.block_hash[block_id] == block_hash
                assert pool.block_group[block_id] == group_id
                indexed += 1
    # Each hash is kept in the shard its last byte names (a lookup reads only that one).
    for group_id in range(pool.num_groups):
        for shard_id, shard in enumerate(pool.cached_shards(group_id)):
            assert all(h[-1] & pool.shard_mask == shard_id for h in shard), (
                f"group {group_id}: a hash in shard {shard_id} belongs to another"
            )
    carrying = sum(1 for b in range(pool.num_blocks) if pool.block_hash[b] is not None)
    assert indexed == carrying == pool.num_cached_blocks
    assert pool.block_hash[NULL_BLOCK_ID] is None
