"""Per-attention-type managers: the block table of one KV cache group and its rules.

Every manager answers the same questions for its group: how many blocks a request needs,
which cached blocks a prefix hits, which blocks fell out of the attention window (replaced by
the null block and freed), and which full blocks to cache. The coordinator asks each group's
manager and combines the answers.

Token-range vocabulary (one request, one group)::

    | skipped (null) | computed, attended to  | new (to compute) | lookahead |
    0                ^ num_skipped_tokens      ^ num_computed     ^          ^ num_tokens
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any, ClassVar

from kvsvc.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvsvc.core.hashing import BlockHashList, hashes_at_block_size
from kvsvc.core.request import RequestState
from kvsvc.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group (full attention semantics unless overridden).

    Args:
        spec: the group's spec.
        pool: the pool shared by all groups.
        group_id: the group's index.
        enable_caching: whether full blocks are cached and prefixes looked up.
        hash_block_size: granularity of the request's block hashes.
    """

    # Whether tables can hold null entries (sliding window, chunked local, Mamba).
    may_drop_blocks: ClassVar[bool] = False

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        self.kv_cache_spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        # request id -> block table (null entries where blocks were dropped).
        self.req_to_blocks: dict[str, list[int]] = {}
        # request id -> table entries already through cache_blocks. Present for every
        # request past its first allocation (the "running request" fast path).
        self.num_cached_block: dict[str, int] = {}
        self._leading_nulls: dict[str, int] = {}

    # -- sizing --------------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Blocks the free queue must supply so the request has ``num_tokens`` slots.

        Counts new blocks plus prefix-hit blocks that are free now (touching them takes them
        out of the free queue).

        Args:
            request_id: the request.
            num_tokens: token slots needed, including those already allocated.
            new_computed_blocks: prefix-hit blocks not yet in the table (first call only).
            total_computed_tokens: computed tokens, cached and external included.
            num_tokens_main_model: ``num_tokens`` without lookahead slots.
        """
        num_required = cdiv(num_tokens, self.block_size)
        if request_id in self.num_cached_block:
            # A running request never gets new prefix hits. With speculative decoding the
            # table can be longer than needed (rejected drafts), hence the max.
            assert not new_computed_blocks
            return max(num_required - len(self.req_to_blocks[request_id]), 0)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed = len(new_computed_blocks) + num_req_blocks
        num_new = max(num_required - max(num_skipped_blocks, num_local_computed), 0)
        # Hits that fall out of the window are never touched, so they cost nothing.
        first_kept = max(0, num_skipped_blocks - num_req_blocks)
        return num_new + self._num_evictable(new_computed_blocks[first_kept:])

    def _num_evictable(self, block_ids: Sequence[int]) -> int:
        # Null's reference count is never 0, so it is excluded without a test.
        return list(map(self.pool.ref_cnt.__getitem__, block_ids)).count(0)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token no longer attends to (0: keep everything)."""
        return 0

    def get_num_freeable_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue (a dry run)."""
        _, skipped = self._skipped_blocks(request_id, total_computed_tokens)
        return list(map(self.pool.ref_cnt.__getitem__, skipped)).count(1)

    def _skipped_blocks(self, request_id: str, total_computed_tokens: int) -> tuple[int, list[int]]:
        """Table entries that fell out of the window and are not null yet.

        Returns:
            The index after the last skipped entry, and the entries, tail first (they are
            the run just before that index).
        """
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return 0, []
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0, []
        # The window may already reach into tokens without blocks (external tokens).
        end = min(num_skipped_tokens // self.block_size, len(blocks))
        found: list[int] = []
        for i in range(end - 1, -1, -1):
            if blocks[i] == NULL_BLOCK_ID:
                # Earlier entries were nulled by an earlier call.
                break
            found.append(blocks[i])
        return end, found

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Null out and free the blocks no longer attended to, tail first.

        The tail of the dropped run covers the longer prefix, so it is evicted first.
        """
        end, removed = self._skipped_blocks(request_id, total_computed_tokens)
        if removed:
            self.req_to_blocks[request_id][end - len(removed) : end] = [NULL_BLOCK_ID] * len(
                removed
            )
            self.pool.free_blocks(removed)

    # -- allocation ----------------------------------------------------------------------

    def add_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[int],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> int:
        """Start a new request's table with its prefix hits (touched, so not evicted).

        Hits that already fell out of the window become null entries instead.

        Returns:
            The external tokens still inside the window: blocks for them are allocated by
            ``allocate_external_blocks`` once every group has touched its hits.
        """
        if request_id in self.num_cached_block:
            assert not new_computed_blocks, "a running request cannot get new prefix hits"
            return 0
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        num_skipped_blocks = num_skipped_tokens // self.block_size
        if num_skipped_blocks > 0:
            # Possibly every hit is skipped, and some external tokens too.
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
            num_external_computed_tokens = min(
                num_total - num_skipped_tokens, num_external_computed_tokens
            )
        if self.enable_caching:
            self.pool.touch(new_computed_blocks)
        else:
            assert not new_computed_blocks, "prefix hits without prefix caching"
        if num_skipped_blocks > 0:
            req_blocks.extend([NULL_BLOCK_ID] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        # Hits (and their null stand-ins) are cached already.
        self.num_cached_block[request_id] = len(req_blocks)
        return num_external_computed_tokens

    def allocate_external_blocks(self, request_id: str, num_total_computed_tokens: int) -> None:
        """Blocks for computed tokens whose KV a connector supplies (not in the prefix cache)."""
        req_blocks = self.req_to_blocks[request_id]
        num_new = cdiv(num_total_computed_tokens, self.block_size) - len(req_blocks)
        if num_new > 0:
            req_blocks.extend(self.pool.get_new_blocks(num_new))

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[int]:
        """Grow the table to ``num_tokens`` slots.

        Returns:
            The entries appended to the table this call.
        """
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: RequestState, num_tokens: int) -> None:
        """Cache the table's blocks that are full once ``num_tokens`` tokens are computed."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.pool.cache_full_blocks(
            self.req_to_blocks[request_id],
            hashes_at_block_size(request.block_hashes, self.hash_block_size, self.block_size),
            num_cached,
            num_full,
            self.group_id,
            self.block_size,
            request.all_token_ids,
            request.lora_name,
            self.cache_mask(request, num_cached, num_full),
            extra_keys=request.extra_keys,
        )
        self.num_cached_block[request_id] = num_full

    def cache_mask(
        self, request: RequestState, start_block: int, end_block: int
    ) -> list[bool] | None:
        """Which of blocks ``start_block..end_block`` to cache (None: every one).

        Full attention caches every full block: any prefix of them can be a hit.
        """
        return None

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (tails are evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request_id, None)
        self._leading_nulls.pop(request_id, None)

    # -- state (persistence) -------------------------------------------------------------

    def request_state(self, request_id: str) -> list[Any]:
        """What this group keeps for one request: ``[table, num_cached_block or -1]``
        (subclasses append their own). The leading-null count is a memo, not state."""
        table = self.req_to_blocks.get(request_id)
        return [
            None if table is None else list(table),
            self.num_cached_block.get(request_id, -1),
        ]

    def load_request_state(self, request_id: str, state: list[Any]) -> None:
        """Take over one request's entry from :meth:`request_state`."""
        table, num_cached = state[0], state[1]
        if table is not None:
            self.req_to_blocks[request_id] = list(table)
        if num_cached >= 0:
            self.num_cached_block[request_id] = num_cached

    def num_tracked_requests(self) -> int:
        """Requests with an entry in this group (every live request, once admitted)."""
        return len(self.req_to_blocks.keys() | self.num_cached_block.keys())

    def to_state(self) -> dict[str, Any]:
        """This group's state besides its requests' entries."""
        return {"kind": type(self).__name__, "block_size": self.block_size}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over :meth:`to_state`; requests' entries come through
        :meth:`load_request_state`. Containers are cleared in place (the manager above
        keeps references to them).

        Raises:
            ValueError: the state is of another kind of group.
        """
        if state["kind"] != type(self).__name__ or state["block_size"] != self.block_size:
            raise ValueError(
                f"group {self.group_id} is {type(self).__name__} with block size "
                f"{self.block_size}; the state is {state['kind']} with {state['block_size']}"
            )
        self.req_to_blocks.clear()
        self.num_cached_block.clear()
        self._leading_nulls.clear()

    # -- queries -------------------------------------------------------------------------

    def num_leading_null_blocks(self, request_id: str) -> int:
        """Null entries at the start of the table (amortised O(1): they only grow)."""
        if not self.may_drop_blocks:
            return 0
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        count = self._leading_nulls.get(request_id, 0)
        while count < len(blocks) and blocks[count] == NULL_BLOCK_ID:
            count += 1
        self._leading_nulls[request_id] = count
        return count

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks held by every request with blocks in this group (cascade attention)."""
        num_requests = len(self.req_to_blocks)
        ref = self.pool.ref_cnt
        count = 0
        for block_id in self.req_to_blocks.get(running_request_id, ()):
            if ref[block_id] != num_requests:
                break
            count += 1
        return count

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
        """The longest cached prefix of at most ``max_length`` tokens, hit in every group.

        Full attention scans left to right: a chained hash that misses means every later
        one misses too. The hit is shortened to a multiple of ``alignment_tokens``.

        Returns:
            Per group in ``group_ids``, the hit blocks (equal lengths).
        """
        block_size = spec.block_size
        max_num_blocks = max_length // block_size
        if len(group_ids) == 1:
            index = pool.cached_index(group_ids[0])
            hits: list[int] = []
            for block_hash in islice(block_hashes, max_num_blocks):
                block_id = index.get(block_hash)
                if block_id is None:
                    break
                hits.append(block_id)
            computed: tuple[list[int], ...] = (hits,)
        else:
            computed = tuple([] for _ in group_ids)
            for block_hash in islice(block_hashes, max_num_blocks):
                cached = pool.get_cached_block(block_hash, group_ids)
                if cached is None:
                    break
                for blocks, block_id in zip(computed, cached, strict=True):
                    blocks.append(block_id)
        if block_size != alignment_tokens:
            while len(computed[0]) * block_size % alignment_tokens:
                for blocks in computed:
                    blocks.pop()
        return computed


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA): every block is kept until the request ends."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: blocks wholly before the window become null and are freed."""

    may_drop_blocks = True

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            spec, pool, group_id, enable_caching=enable_caching, hash_block_size=hash_block_size
        )
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

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            spec, pool, group_id, enable_caching=enable_caching, hash_block_size=hash_block_size
        )
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


class MambaManager(SingleTypeKVCacheManager):
    """Mamba / SSM state blocks, per ``mamba_cache_mode``.

    ``none``: one running state (plus speculative blocks); never cached, never hit.
    ``align``: the state at each block boundary is a cache entry; the table keeps the state
    of the previous step (copied into the current one) and nulls the rest.
    ``all``: one state per block, all kept and cached.
    A hit is the last cached state at or below the limit: ``[NULL] * i + [state_i]``.
    """

    may_drop_blocks = True

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            spec, pool, group_id, enable_caching=enable_caching, hash_block_size=hash_block_size
        )
        assert isinstance(spec, MambaSpec)
        self.mamba_cache_mode = spec.mamba_cache_mode
        self.num_speculative_blocks = spec.num_speculative_blocks
        # align mode: table index of the state allocated in the previous step, and the
        # requests that got state blocks already.
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

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
        assert isinstance(spec, MambaSpec)
        computed: tuple[list[int], ...] = tuple([] for _ in group_ids)
        if spec.mamba_cache_mode == "none":
            return computed
        block_size = spec.block_size
        for i in range(max_length // block_size - 1, -1, -1):
            cached = pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            for blocks, block_id in zip(computed, cached, strict=True):
                # Hit length is read off the list length, so pad with nulls.
                blocks.extend([NULL_BLOCK_ID] * i)
                blocks.append(block_id)
            break
        return computed

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the state after the last computed token is needed (``all`` keeps every one)."""
        if self.mamba_cache_mode == "all":
            return 0
        return num_computed_tokens - 1

    def _last_state_to_free(self, request_id: str, num_computed_tokens: int) -> int | None:
        if self.mamba_cache_mode != "align":
            return None
        idx = self.last_state_block_idx.get(request_id)
        if idx is None or idx >= cdiv(num_computed_tokens, self.block_size) - 1:
            return None
        blocks = self.req_to_blocks.get(request_id)
        return idx if blocks and blocks[idx] != NULL_BLOCK_ID else None

    def get_num_freeable_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> int:
        count = super().get_num_freeable_skipped_blocks(request_id, total_computed_tokens)
        idx = self._last_state_to_free(request_id, total_computed_tokens)
        if idx is not None:
            block_id = self.req_to_blocks[request_id][idx]
            _, skipped = self._skipped_blocks(request_id, total_computed_tokens)
            if block_id not in skipped and self.pool.ref_cnt[block_id] == 1:
                count += 1
        return count

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        super().remove_skipped_blocks(request_id, total_computed_tokens)
        # The state allocated two steps ago was copied forward; it is no longer needed.
        idx = self._last_state_to_free(request_id, total_computed_tokens)
        if idx is not None:
            blocks = self.req_to_blocks[request_id]
            self.pool.free_blocks([blocks[idx]])
            blocks[idx] = NULL_BLOCK_ID

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[int],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        if self.mamba_cache_mode != "align":
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
            )
        # Lookahead slots would break the block alignment; drafts have no Mamba layers.
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        num_new = (
            num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        )
        if num_new > 0:
            # A running request reuses last step's speculative blocks: one more at most.
            num_new = (
                1 if request_id in self._allocated_block_reqs else 1 + self.num_speculative_blocks
            )
        return max(num_new, 0) + self._num_evictable(new_computed_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[int]:
        if self.mamba_cache_mode != "align":
            return super().allocate_new_blocks(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model,
            )
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_spec = self.num_speculative_blocks
        num_required = cdiv(num_tokens_main_model, self.block_size) + num_spec
        if num_required <= len(req_blocks):
            # Fewer drafts than last step: the table is long enough already.
            return []
        prev_len = len(req_blocks)
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            # The running state sits in the last (1 + num_spec) entries.
            self.last_state_block_idx[request_id] = prev_len - 1 - num_spec
        elif prev_len > 0:
            # A prefix hit: its last entry holds the hit state.
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped = num_required - num_spec - 1
        if prev_len < num_skipped:
            req_blocks.extend([NULL_BLOCK_ID] * (num_skipped - prev_len))
        if allocated_before:
            # Move last step's speculative blocks forward instead of allocating new ones.
            for idx in range(prev_len - num_spec, prev_len):
                if idx >= num_skipped:
                    break
                req_blocks.append(req_blocks[idx])
                req_blocks[idx] = NULL_BLOCK_ID
        num_new = num_required - len(req_blocks)
        assert num_new <= (1 if allocated_before else 1 + num_spec)
        req_blocks.extend(self.pool.get_new_blocks(num_new))
        self._allocated_block_reqs.add(request_id)
        return req_blocks[prev_len:]

    def cache_blocks(self, request: RequestState, num_tokens: int) -> None:
        if self.mamba_cache_mode == "none":
            # The running state is overwritten in place: no block is a stable prefix state.
            return
        super().cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        super().free(request_id)

    def request_state(self, request_id: str) -> list[Any]:
        """The base entry plus ``[last_state_block_idx or -1, got state blocks]``."""
        return [
            *super().request_state(request_id),
            self.last_state_block_idx.get(request_id, -1),
            request_id in self._allocated_block_reqs,
        ]

    def load_request_state(self, request_id: str, state: list[Any]) -> None:
        super().load_request_state(request_id, state)
        if state[2] >= 0:
            self.last_state_block_idx[request_id] = state[2]
        if state[3]:
            self._allocated_block_reqs.add(request_id)

    def num_tracked_requests(self) -> int:
        return len(
            self.req_to_blocks.keys()
            | self.num_cached_block.keys()
            | self.last_state_block_idx.keys()
            | self._allocated_block_reqs
        )

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.last_state_block_idx.clear()
        self._allocated_block_reqs.clear()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross attention: a static table sized by the encoder input; never cached or shared."""

    def add_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[int],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> int:
        assert not new_computed_blocks, "cross-attention blocks are never prefix hits"
        self.req_to_blocks.setdefault(request_id, [])
        self.num_cached_block.setdefault(request_id, 0)
        return 0

    def allocate_external_blocks(self, request_id: str, num_total_computed_tokens: int) -> None:
        return

    def cache_blocks(self, request: RequestState, num_tokens: int) -> None:
        # Encoder states are per request: nothing to share.
        return

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        return 0

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
        raise NotImplementedError("cross-attention groups do not take part in prefix caching")


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention plus ``sink_len`` attention-sink tokens held for the pool's lifetime."""

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            spec, pool, group_id, enable_caching=enable_caching, hash_block_size=hash_block_size
        )
        assert isinstance(spec, SinkFullAttentionSpec)
        sink_len = spec.sink_len
        if not sink_len or sink_len < 0 or sink_len % self.block_size:
            raise ValueError(
                f"sink_len={sink_len} must be a positive multiple of the group's block size "
                f"{self.block_size}"
            )
        self.sink_blocks = pool.reserve_blocks(sink_len // self.block_size)

    def to_state(self) -> dict[str, Any]:
        return {**super().to_state(), "sink_blocks": list(self.sink_blocks)}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.sink_blocks = list(state["sink_blocks"])


def representative_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The per-layer spec a group's manager follows (a uniform-type group's first layer)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.first_spec
    return spec


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class of a group spec.

    Raises:
        ValueError: a spec kind the scheduler side does not manage (encoder-only layers
            have no KV cache to manage).
    """
    spec = representative_spec(spec)
    # Most specific first: sink and MLA are full attention, sliding-window MLA is sliding.
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager
    if isinstance(spec, SinkFullAttentionSpec):
        return SinkFullAttentionManager
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, MambaSpec):
        return MambaManager
    raise ValueError(
        f"KV cache group spec {type(spec).__name__} ({spec.kind.value}) has no block manager; "
        "managed kinds: full/MLA/sink attention, sliding window, chunked local, Mamba, "
        "cross attention"
    )


def make_manager(
    spec: KVCacheSpec,
    pool: BlockPool,
    group_id: int,
    *,
    enable_caching: bool,
    hash_block_size: int,
) -> SingleTypeKVCacheManager:
    """The manager for one group (a uniform-type group is managed by its first layer's type)."""
    cls = manager_class_for(spec)
    return cls(
        representative_spec(spec),
        pool,
        group_id,
        enable_caching=enable_caching,
        hash_block_size=hash_block_size,
    )
