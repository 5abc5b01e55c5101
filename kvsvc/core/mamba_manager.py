"""The manager of state-space (Mamba) groups: fixed-size state blocks, not token pages.

A Mamba layer's KV is one recurrent state, whatever the length; ``mamba_cache_mode`` says
which states are kept as blocks (the running one, the one at each block boundary, or one
per block) and so what a prefix hit and a step's allocation are. Refines
:class:`~kvsvc.core.single_type_manager.SingleTypeKVCacheManager` throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsvc.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvsvc.core.hashing import BlockHashList
from kvsvc.core.request import RequestState
from kvsvc.core.single_type_manager import SingleTypeKVCacheManager
from kvsvc.specs import KVCacheSpec, MambaSpec, cdiv


class MambaManager(SingleTypeKVCacheManager):
    """Mamba / SSM state blocks, per ``mamba_cache_mode``.

    ``none``: one running state (plus speculative blocks); never cached, never hit.
    ``align``: the state at each block boundary is a cache entry; the table keeps the state
    of the previous step (copied into the current one) and nulls the rest.
    ``all``: one state per block, all kept and cached.
    A hit is the last cached state at or below the limit: ``[NULL] * i + [state_i]``.
    """

    may_drop_blocks = True

    def _take_spec(self, spec: KVCacheSpec) -> None:
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
