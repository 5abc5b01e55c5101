"""Sliding-window and chunked-local managers: hit lengths, dropped blocks, sizing."""

from __future__ import annotations

import random

from core_factories import chunked_spec, free_order, sliding_spec

from kvsvc.core import (
    NULL_BLOCK_ID,
    BlockPool,
    ChunkedLocalAttentionManager,
    SlidingWindowManager,
)


def pool_with_cached(block_is_cached: list[bool]) -> tuple[BlockPool, list[bytes]]:
    """A pool where block ``i + 10`` is cached under hash ``str(i)`` when flagged."""
    pool = BlockPool(100)
    held = pool.get_new_blocks(99)
    assert held[9] == 10
    hashes = [str(i).encode() for i in range(len(block_is_cached))]
    for i, cached in enumerate(block_is_cached):
        if cached:
            pool.cache_full_blocks([i + 10], [hashes[i]], 0, 1, 0, 2)
    return pool, hashes


def test_sliding_window_hit_needs_a_window_of_consecutive_blocks() -> None:
    # Block size 2, window 4: ceil(3 / 2) = 2 consecutive cached blocks make a hit.
    spec = sliding_spec(2, 4)

    def hit(block_is_cached: list[bool], expect_length: int) -> None:
        pool, hashes = pool_with_cached(block_is_cached)
        (blocks,) = SlidingWindowManager.find_longest_cache_hit(
            hashes, len(hashes) * 2, (0,), pool, spec, 2
        )
        assert len(blocks) == expect_length
        assert all(b == NULL_BLOCK_ID for b in blocks[: expect_length - 2])
        for i in range(min(2, expect_length)):
            index = expect_length - i - 1
            assert blocks[index] == index + 10

    hit([False] * 10, 0)
    hit([True], 1)
    hit([True, False], 1)
    hit([True, True], 2)
    hit([True, True, False], 2)
    hit([True, True, True], 3)
    hit([True, True, True, False], 3)
    hit([True, True, False, True, False, False, True, True, False, True, True, True], 12)
    hit([True, True, False, True, False, False, True, True, False, False, False], 8)
    hit([True, True, False, True, False, False, True, True, False, False, False, True], 8)


def test_chunked_local_hit_counts_earlier_chunks_as_computed() -> None:
    # Block size 2, chunk 4: blocks of chunks before the last one are null.
    spec = chunked_spec(2, 4)

    def hit(block_is_cached: list[bool], tail: int, expect_length: int) -> None:
        pool, hashes = pool_with_cached(block_is_cached)
        (blocks,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
            hashes, len(hashes) * 2 + tail, (0,), pool, spec, 2
        )
        assert len(blocks) == expect_length
        assert all(b == NULL_BLOCK_ID for b in blocks[: (expect_length - 1) // 2])

    rng = random.Random(0)
    hit([True], 0, 1)
    hit([True], 1, 1)
    hit([True, False], 0, 2)
    hit([True, False], 1, 2)
    hit([True, True], 0, 2)
    hit([True, True], 1, 2)
    hit([True, True, False], 0, 2)
    hit([True, True, False], 1, 2)
    hit([True, True, True], 0, 3)
    hit([True, True, True], 1, 3)
    hit([True, True, True, False], 0, 4)
    hit([True, True, True, False], 1, 4)
    hit([rng.choice([True, False])] * 8 + [True], 1, 9)
    hit([rng.choice([True, False])] * 8 + [False], 1, 8)
    hit([rng.choice([True, False])] * 8 + [True, True], 1, 10)
    hit([rng.choice([True, False])] * 8 + [True, False], 0, 10)
    hit([rng.choice([True, False])] * 8 + [False, False], 1, 10)


def _manager_with_table(
    cls: type, spec: object, cache_all: bool
) -> tuple[BlockPool, object, list[int]]:
    pool = BlockPool(40)
    manager = cls(spec, pool, 0, enable_caching=True, hash_block_size=2)
    table = pool.get_new_blocks(11)
    if cache_all:
        pool.cache_full_blocks(table, [str(i).encode() for i in range(11)], 0, 11, 0, 2)
    manager.req_to_blocks["test"] = table
    manager.num_cached_block["test"] = 11
    return pool, manager, list(table)


def test_sliding_window_drops_blocks_that_left_the_window() -> None:
    pool, manager, original = _manager_with_table(SlidingWindowManager, sliding_spec(2, 4), True)
    table = manager.req_to_blocks["test"]  # type: ignore[attr-defined]
    untouched = free_order(pool)

    manager.remove_skipped_blocks("test", 0)  # type: ignore[attr-defined]
    assert table == original
    # 4 computed: only token 0 left the window; block 0 still holds token 1.
    manager.remove_skipped_blocks("test", 4)  # type: ignore[attr-defined]
    assert table == original
    # 5 computed: tokens 0 and 1 left, so block 0 goes.
    manager.remove_skipped_blocks("test", 5)  # type: ignore[attr-defined]
    assert table == [0, *original[1:]]
    assert free_order(pool) == [*untouched, original[0]]
    # 6 computed: token 3 still needs block 1.
    manager.remove_skipped_blocks("test", 6)  # type: ignore[attr-defined]
    assert table == [0, *original[1:]]
    manager.remove_skipped_blocks("test", 7)  # type: ignore[attr-defined]
    assert table == [0, 0, *original[2:]]
    # 11 computed: blocks 2 and 3 go, the longer prefix (3) first in eviction order.
    manager.remove_skipped_blocks("test", 11)  # type: ignore[attr-defined]
    assert table == [0, 0, 0, 0, *original[4:]]
    assert free_order(pool) == [*untouched, original[0], original[1], original[3], original[2]]
    assert manager.num_leading_null_blocks("test") == 4  # type: ignore[attr-defined]


def test_chunked_local_drops_the_chunks_before_the_current_one() -> None:
    pool, manager, original = _manager_with_table(
        ChunkedLocalAttentionManager, chunked_spec(2, 4), False
    )
    table = manager.req_to_blocks["test"]  # type: ignore[attr-defined]
    head = free_order(pool)[0]
    manager.remove_skipped_blocks("test", 0)  # type: ignore[attr-defined]
    assert table == original
    # Token 4 starts a new chunk: tokens 0-3 (two blocks) are out.
    manager.remove_skipped_blocks("test", 4)  # type: ignore[attr-defined]
    assert table == [0, 0, *original[2:]]
    # Uncached blocks go to the front of the queue, tail first.
    assert free_order(pool)[:3] == [original[1], original[0], head]
    manager.remove_skipped_blocks("test", 6)  # type: ignore[attr-defined]
    assert table == [0, 0, *original[2:]]
    manager.remove_skipped_blocks("test", 12)  # type: ignore[attr-defined]
    assert table == [0] * 6 + original[6:]


def test_removal_frees_only_blocks_no_one_else_holds() -> None:
    pool, manager, original = _manager_with_table(SlidingWindowManager, sliding_spec(2, 4), True)
    pool.touch([original[2]])  # another holder: dropping it frees nothing
    before = pool.get_num_free_blocks()
    manager.remove_skipped_blocks("test", 11)  # type: ignore[attr-defined]
    assert pool.get_num_free_blocks() == before + 3


def test_sizing_counts_free_hits_and_skips_nulls() -> None:
    pool = BlockPool(100)
    for cls, spec in (
        (SlidingWindowManager, sliding_spec(2, 4)),
        (ChunkedLocalAttentionManager, chunked_spec(2, 4)),
    ):
        manager = cls(spec, pool, 0, enable_caching=True, hash_block_size=2)
        # Free (ref 0) hit blocks must leave the free queue: they count.
        free_hits = list(range(1, 11))
        assert manager.get_num_blocks_to_allocate("1", 40, free_hits, 0, 40) == 20
        half_null = [NULL_BLOCK_ID] * 5 + list(range(1, 6))
        assert manager.get_num_blocks_to_allocate("2", 40, half_null, 0, 40) == 15
