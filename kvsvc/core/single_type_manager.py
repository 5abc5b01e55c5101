"""One KV cache group's block tables: the manager every attention kind refines.

:class:`SingleTypeKVCacheManager` holds a group's tables and answers, with full
attention's rules, what the coordinator asks every group: how many blocks a request needs,
which cached blocks a prefix hits, which blocks fell out of the attention window (replaced
by the null block and freed), and which full blocks to cache. The kinds whose tables keep
every block live here too (full attention and MLA, attention sinks, cross attention);
those that drop blocks refine it in :mod:`kvsvc.core.window_managers` and
:mod:`kvsvc.core.mamba_manager`, and :mod:`kvsvc.core.managers` picks a group's manager.

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
from kvsvc.specs import KVCacheSpec, SinkFullAttentionSpec, cdiv


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
        self._take_spec(spec)

    def _take_spec(self, spec: KVCacheSpec) -> None:
        """Read what this kind of attention needs from its group's spec.

        A hook for the subclasses (the window, the chunk, the sink, Mamba's mode), so that
        every manager is built through one constructor with one signature: the pool builds
        them all alike, by spec kind. It runs last in ``__init__``, on a complete manager.
        """

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
            lora_id=request.lora_id,
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
            shards = pool.cached_shards(group_ids[0])
            mask = pool.shard_mask
            hits: list[int] = []
            for block_hash in islice(block_hashes, max_num_blocks):
                block_id = shards[block_hash[-1] & mask].get(block_hash)
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

    def _take_spec(self, spec: KVCacheSpec) -> None:
        assert isinstance(spec, SinkFullAttentionSpec)
        sink_len = spec.sink_len
        if not sink_len or sink_len < 0 or sink_len % self.block_size:
            raise ValueError(
                f"sink_len={sink_len} must be a positive multiple of the group's block size "
                f"{self.block_size}"
            )
        self.sink_blocks = self.pool.reserve_blocks(sink_len // self.block_size)

    def to_state(self) -> dict[str, Any]:
        return {**super().to_state(), "sink_blocks": list(self.sink_blocks)}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.sink_blocks = list(state["sink_blocks"])
