"""Sparse retention of sliding-window blocks (vLLM's ``prefix_cache_retention_interval``),
checked against vLLM's rules on block-aligned prompts.

vLLM (``SlidingWindowManager.reachable_block_mask``, no EAGLE) caches block ``i`` of a
request when a later hit can read it:

- a hit at length L needs the ``need = cdiv(window - 1, block_size)`` blocks before L;
- with ``retention_interval = N > 0``, every N-token segment keeps its last ``need``
  blocks: ``i % (N // block_size) >= N // block_size - need`` (the hits at N, 2N, ...);
- whatever the interval (0 included), the tail before each reachable boundary is kept:
  the prompt's end ``num_prompt_tokens - 1`` (a re-sent prompt recomputes its last
  token, so its hit stops there) aligned down to the block, i.e. blocks
  ``[end - need, end)`` with ``end = (num_prompt_tokens - 1) // block_size``.

Block size 4 and a window of 8 tokens throughout: ``need = cdiv(7, 4) = 2``.
"""

from __future__ import annotations

import pytest
from core_factories import admit, full_spec, make_config, make_request, sliding_spec

from kvsvc.core import NULL_BLOCK_ID, KVCacheManager

BLOCK = 4
WINDOW = 8


def window_manager(interval: int) -> KVCacheManager:
    return KVCacheManager(
        make_config(64, sliding_spec(BLOCK, WINDOW)),
        1024,
        hash_algo="sha256_cbor",
        prefix_cache_retention_interval=interval,
    )


def cached_positions(manager: KVCacheManager, table: list[int]) -> list[int]:
    """Which entries of a block table carry a hash (are findable by a later hit)."""
    pool = manager.block_pool
    return [i for i, block in enumerate(table) if block != NULL_BLOCK_ID and pool.block_hash[block]]


def run_and_free(manager: KVCacheManager, request_id: str, prompt: list[int]) -> list[int]:
    """Admit ``prompt`` whole (one prefill step), free it; its block table."""
    request = make_request(manager, request_id, prompt)
    _, num_hits, blocks = admit(manager, request)
    assert num_hits == 0 and blocks is not None
    table = list(manager.coordinator.managers[0].req_to_blocks[request_id])
    manager.free(request)
    return table


def test_a_resent_block_aligned_prompt_hits_the_window_before_its_last_token() -> None:
    """Interval 0 (vLLM's default), a 16-token prompt (4 blocks, block aligned).

    vLLM: boundary 16 - 1 = 15, aligned down to 12: end = 3, so blocks [1, 2] are kept;
    no segment tails (interval 0). The same prompt sent again may hit at most 15 tokens,
    i.e. 3 blocks: the window before 12 is blocks 1 and 2, both cached: a 12-token hit
    ``[NULL, b1, b2]``. (Keeping the tail before 16 instead, blocks [2, 3], leaves
    block 1 out: no hit at all.)
    """
    manager = window_manager(0)
    prompt = list(range(100, 116))
    table = run_and_free(manager, "first", prompt)
    assert len(table) == 4
    assert cached_positions(manager, table) == [1, 2]

    again = make_request(manager, "again", prompt)
    hits, num_hits = manager.get_computed_blocks(again)
    assert num_hits == 12
    assert list(hits.blocks[0]) == [NULL_BLOCK_ID, table[1], table[2]]


def test_a_positive_interval_keeps_a_window_tail_per_segment() -> None:
    """Interval 16 tokens = 4 blocks per segment, a 40-token prompt (10 blocks).

    vLLM: segment tails ``i % 4 >= 4 - 2``: blocks 2, 3, 6, 7; the prompt's boundary
    39 -> 36: end = 9, blocks [7, 8]. Cached: {2, 3, 6, 7, 8}; blocks 0, 1, 4, 5 and 9
    get no hash. A later prompt sharing the first 16 (or 32) tokens then differing
    hits at 16 (32): the window before it, blocks 2-3 (6-7), is cached.
    """
    manager = window_manager(16)
    prompt = list(range(200, 240))
    table = run_and_free(manager, "long", prompt)
    assert len(table) == 10
    assert cached_positions(manager, table) == [2, 3, 6, 7, 8]

    for shared, window_blocks in ((16, [2, 3]), (32, [6, 7])):
        other = make_request(manager, f"shares-{shared}", prompt[:shared] + [7] * 9)
        hits, num_hits = manager.get_computed_blocks(other)
        assert num_hits == shared
        expected = [NULL_BLOCK_ID] * (shared // BLOCK)
        for i in window_blocks:
            expected[i] = table[i]
        assert list(hits.blocks[0]) == expected


def test_an_interval_is_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ValueError, match="multiple of the block size 4, got 6"):
        window_manager(6)


def test_a_shared_prefix_junction_keeps_its_window_tail() -> None:
    """Full attention + a sliding window (interval 0): prompts share 16 tokens S, then
    differ (8 tokens each, 24 in all: 6 blocks).

    The first caches every full-attention block, and in the window group only the tail
    before its end: 23 -> 20, blocks [3, 4]. The second finds S in full attention (16
    tokens) but no window hit at 16 (block 2 is not cached): its admission found a longer
    hit in one group than in all of them, a junction at 16 (vLLM's
    ``shared_prefix_boundary``), so it keeps the window tail before 16 as well: blocks
    [2, 3], and [3, 4] for its own end. The third then hits S whole: 16 tokens, the
    window group reading blocks 2 and 3 only.
    """
    manager = KVCacheManager(
        make_config(64, full_spec(BLOCK), sliding_spec(BLOCK, WINDOW)),
        1024,
        hash_algo="sha256_cbor",
        prefix_cache_retention_interval=0,
    )
    shared = list(range(300, 316))
    window_group = manager.coordinator.managers[1]
    tables = []
    # What each keeps is read at once: the blocks it frees uncached are reused next.
    for n, (tail, kept) in enumerate(((range(400, 408), [3, 4]), (range(500, 508), [2, 3, 4]))):
        request = make_request(manager, f"r{n}", shared + list(tail))
        hits, num_hits = manager.get_computed_blocks(request)
        assert num_hits == 0
        assert manager.allocate_slots(request, 24, num_hits, hits) is not None
        tables.append(list(window_group.req_to_blocks[f"r{n}"]))
        assert cached_positions(manager, tables[n]) == kept
        manager.free(request)

    third = make_request(manager, "r2", shared + list(range(600, 608)))
    hits, num_hits = manager.get_computed_blocks(third)
    assert num_hits == 16
    # Block 3 of S is cached twice (by both): the first copy is found.
    assert list(hits.blocks[1]) == [NULL_BLOCK_ID, NULL_BLOCK_ID, tables[1][2], tables[0][3]]
