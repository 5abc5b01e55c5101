"""Managers of attention kinds with a window: blocks before it become null and are freed.

Sliding-window attention keeps the last ``sliding_window`` tokens, chunked local attention
the current chunk. Both refine :class:`~kvsvc.core.single_type_manager.SingleTypeKVCacheManager`
where a window changes the answer: which leading tokens are skipped, what a prefix hit needs
(only the blocks inside the window before it), which blocks are worth caching, and that
cascade attention has no common prefix to share.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsvc.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvsvc.core.hashing import BlockHashList
from kvsvc.core.request import RequestState
from kvsvc.core.single_type_manager import SingleTypeKVCacheManager
from kvsvc.specs import ChunkedLocalAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: blocks wholly before the window become null and are freed."""

    may_drop_blocks = True

    def _take_spec(self, spec: KVCacheSpec) -> None:
        assert isinstance(spec, SlidingWindowSpec)
        self.sliding_window = spec.sliding_window
        # vLLM's prefix_cache_retention_interval: None caches every full block; 0 only
        # the window's blocks before the reachable boundaries (the prompt's end and a
        # shared-prefix junction); N > 0 also one window tail per N-token segment. Set by
        # the pool (KVCacheManager), as is the hit alignment (the scheduler block size).
        self.retention_interval: int | None = None
        self.alignment_tokens = self.block_size

    def cache_mask(
        self, request: RequestState, start_block: int, end_block: int
    ) -> list[bool] | None:
        """Under sparse retention, only blocks a later hit can use get a hash.

        A window hit at length L needs the ``cdiv(window - 1, block_size)`` blocks before
        L and nothing else, and hits land only where a later request can resume: just
        before the prompt's end (a resend recomputes its last token), at a shared-prefix
        junction the admission's lookup found, and (with a positive interval) at the end
        of each interval-sized segment. Blocks outside those tails are never read by a
        hit, so they are freed without a hash (reused first) instead of evicting blocks
        that could hit: vLLM's sparse retention (``reachable_block_mask``).
        """
        interval = self.retention_interval
        block_size = self.block_size
        alignment = self.alignment_tokens
        if interval is None or alignment % block_size:
            return None
        need = cdiv(self.sliding_window - 1, block_size)
        mask = [False] * (end_block - start_block)
        if interval > 0:
            per_segment = interval // block_size
            if need >= per_segment:
                return None
            for i in range(start_block, end_block):
                if i % per_segment >= per_segment - need:
                    mask[i - start_block] = True
        boundaries = [request.num_prompt_tokens - 1]
        if request.shared_prefix_boundary:
            boundaries.append(request.shared_prefix_boundary)
        for boundary in boundaries:
            end = boundary // alignment * alignment // block_size
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
        return mask

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[list[int], ...]:
        """A hit needs only the blocks inside the window before it.

        Scans right to left for ``cdiv(sliding_window - 1, block_size)`` consecutive cached
        blocks (the next token itself is part of the window); everything before them
        becomes null. Block size 4, window 8: two consecutive blocks suffice,
        ``[NULL, NULL, 7, 8]`` is a 16-token hit.
        """
        assert isinstance(spec, SlidingWindowSpec)
        block_size = spec.block_size
        needed = cdiv(spec.sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        computed = tuple([NULL_BLOCK_ID] * max_num_blocks for _ in group_ids)
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            # A run may only end at an aligned length.
            if (
                num_contiguous == 0
                and block_size != alignment_tokens
                and (i + 1) * block_size % alignment_tokens
            ):
                continue
            for blocks, block_id in zip(computed, cached, strict=True):
                blocks[i] = block_id
            num_contiguous += 1
            if num_contiguous >= needed:
                # Trim what lies after the run: [N, N, 8, 3, N, 9] -> [N, N, 8, 3].
                for blocks in computed:
                    del blocks[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            # A run reaching block 0 is a hit even when shorter than the window.
            for blocks in computed:
                del blocks[num_contiguous:]
            if block_size != alignment_tokens:
                while len(computed[0]) * block_size % alignment_tokens:
                    for blocks in computed:
                        blocks.pop()
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the next token's window.

        Window 4, 7 computed: the next token (index 7) sees tokens 4..7, so 4 are skipped::

            [ 0  1  2  3  4  5  6  7 ]
            |--skipped--|-- window --|
        """
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        # Prefix entries are null for sliding-window groups; cascade attention does not apply.
        return 0


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: a token attends within its chunk; earlier chunks become null."""

    may_drop_blocks = True

    def _take_spec(self, spec: KVCacheSpec) -> None:
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.attention_chunk_size = spec.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        group_ids: Sequence[int],
        pool: BlockPool,
        spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[list[int], ...]:
        """Blocks of earlier chunks count as computed (null); the current chunk must hit.

        Chunk 8, block 4, max length 15: tokens 0-7 lie in an earlier chunk, so the hit is
        ``[NULL, NULL]`` plus block 2 (tokens 8-11) if it is cached.
        """
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        block_size = spec.block_size
        assert block_size == alignment_tokens, (
            "chunked local attention needs every group to share its block size"
        )
        max_num_blocks = max_length // block_size
        chunk = spec.attention_chunk_size
        local_start = max_length // chunk * chunk if max_length > 0 else 0
        first_block = local_start // block_size
        computed = tuple([NULL_BLOCK_ID] * first_block for _ in group_ids)
        for i in range(first_block, max_num_blocks):
            cached = pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                break
            for blocks, block_id in zip(computed, cached, strict=True):
                blocks.append(block_id)
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's chunk.

        Chunk 8: 13 computed -> 8 skipped; 8 computed -> 8; 7 computed -> 0.
        """
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0
