"""The coordinator: one pool, one manager per KV cache group, and the prefix-hit rule.

Three variants, chosen by :func:`make_coordinator`:

- :class:`NoPrefixCacheCoordinator`: caching off (or a group that cannot be cached): any
  number of groups, never a hit.
- :class:`UnitaryCoordinator`: one group; its manager's hit is the hit.
- :class:`HybridCoordinator`: several groups (full + sliding window, + Mamba, ...). A hit
  must be a hit for every group, at a length that is a multiple of every block size.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm

from kvsvc.core.block_pool import BlockPool
from kvsvc.core.hashing import BlockHash, hashes_at_block_size
from kvsvc.core.managers import make_manager
from kvsvc.core.request import RequestState
from kvsvc.core.single_type_manager import CrossAttentionManager, SingleTypeKVCacheManager
from kvsvc.specs import FullAttentionSpec, KVCacheSpec


class KVCacheCoordinator:
    """Fans each table operation out to the groups' managers.

    Args:
        specs: each group's spec, in group order.
        pool: the shared pool.
        enable_caching: whether blocks are cached.
        hash_block_size: granularity of request block hashes.
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        pool: BlockPool,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        self.pool = pool
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(
                spec,
                pool,
                group_id,
                enable_caching=enable_caching,
                hash_block_size=hash_block_size,
            )
            for group_id, spec in enumerate(specs)
        )
        self._is_cross = tuple(isinstance(m, CrossAttentionManager) for m in self.managers)
        # Set by the hybrid find_longest_cache_hit: the longest single-group hit when it
        # is longer than the combined one (else 0).
        self.last_junction = 0
        self._dropping = tuple(m for m in self.managers if m.may_drop_blocks)
        self._first = self.managers[0] if self.managers else None

    @property
    def may_drop_blocks(self) -> bool:
        """Whether any group's table can get null entries."""
        return bool(self._dropping)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    def is_running(self, request_id: str) -> bool:
        """Whether the request got its first allocation (and was not freed since)."""
        first = self._first
        return first is not None and request_id in first.num_cached_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[int]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        """Blocks the free queue must supply, summed over groups."""
        total = 0
        for i, manager in enumerate(self.managers):
            if self._is_cross[i]:
                # One static allocation sized by the encoder input.
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, num_encoder_tokens
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[i],
                    total_computed_tokens,
                    num_tokens_main_model,
                )
        return total

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Null out and free, in every group, blocks the next token no longer attends to."""
        for manager in self._dropping:
            manager.remove_skipped_blocks(request_id, total_computed_tokens)

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[Sequence[int]],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Put a new request's prefix hits in its tables, then allocate external blocks.

        Two phases: every group touches its hits before any group allocates, because an
        allocation pops the free queue's front and could otherwise evict a later group's
        hit that is still free.
        """
        external = [
            manager.add_computed_blocks(
                request_id,
                new_computed_blocks[i],
                num_local_computed_tokens,
                num_external_computed_tokens,
            )
            for i, manager in enumerate(self.managers)
        ]
        num_total = num_local_computed_tokens + num_external_computed_tokens
        for manager, num_external in zip(self.managers, external, strict=True):
            if num_external > 0:
                manager.allocate_external_blocks(request_id, num_total)

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_tokens_main_model: int,
        num_encoder_tokens: int = 0,
    ) -> tuple[list[int], ...]:
        """Grow every table to ``num_tokens`` slots (cross attention: encoder tokens).

        Returns:
            Per group, the entries appended.
        """
        return tuple(
            manager.allocate_new_blocks(
                request_id,
                num_encoder_tokens if self._is_cross[i] else num_tokens,
                num_tokens_main_model,
            )
            for i, manager in enumerate(self.managers)
        )

    def cache_blocks(self, request: RequestState, num_computed_tokens: int) -> None:
        """Cache, in every group, the blocks full once ``num_computed_tokens`` are computed."""
        for manager in self.managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, group by group, each table tail first."""
        for manager in self.managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(running_request_id) for m in self.managers]

    def get_blocks(self, request_id: str) -> tuple[list[int], ...]:
        """The request's tables (the live lists; callers copy before handing out)."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.managers)

    def num_leading_null_blocks(self, request_id: str) -> tuple[int, ...]:
        return tuple(m.num_leading_null_blocks(request_id) for m in self.managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        """The longest prefix of at most ``max_cache_hit_length`` tokens cached in all groups.

        Returns:
            Per group the hit blocks (null where a window lets blocks go), and the hit
            length in tokens.
        """
        raise NotImplementedError


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching off: nothing is ever hit."""

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_groups

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        return tuple([] for _ in self.managers), 0


class UnitaryCoordinator(KVCacheCoordinator):
    """One group: its manager decides the hit."""

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        pool: BlockPool,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            specs, pool, enable_caching=enable_caching, hash_block_size=hash_block_size
        )
        assert len(self.managers) == 1
        self.spec = self.managers[0].kv_cache_spec
        self.block_size = self.spec.block_size
        assert hash_block_size == self.block_size, "one group hashes at its own block size"

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        hits = type(self.managers[0]).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, (0,), self.pool, self.spec, self.block_size
        )
        return hits, len(hits[0]) * self.block_size


class HybridCoordinator(KVCacheCoordinator):
    """Several groups; the hit is the longest length every group can serve.

    Groups with equal specs are looked up together (a hit must exist in each). Each
    attention type either accepts the candidate length or lowers it; any lowering restarts
    the round, so the length only decreases and the loop ends. Full attention goes first:
    its left-to-right scan gives the tightest bound, and a later cut just truncates it.
    """

    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        pool: BlockPool,
        *,
        enable_caching: bool,
        hash_block_size: int,
    ) -> None:
        super().__init__(
            specs, pool, enable_caching=enable_caching, hash_block_size=hash_block_size
        )
        types: list[tuple[KVCacheSpec, list[int], type[SingleTypeKVCacheManager]]] = []
        for group_id, manager in enumerate(self.managers):
            spec = manager.kv_cache_spec
            assert spec.block_size % hash_block_size == 0, (
                "every group's block size must be a multiple of the hash block size"
            )
            for known_spec, group_ids, cls in types:
                if known_spec == spec:
                    assert cls is type(manager)
                    group_ids.append(group_id)
                    break
            else:
                types.append((spec, [group_id], type(manager)))
        self.attention_groups = sorted(types, key=lambda t: not isinstance(t[0], FullAttentionSpec))
        self.lcm_block_size = lcm(*[spec.block_size for spec, _, _ in types])
        # One full-attention type plus one other: a single round is exact (full attention's
        # hit is downward closed, so the other type's cut only truncates it).
        self._single_round = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0][0], FullAttentionSpec
        )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[int], ...], int]:
        hit_length = max_cache_hit_length
        hits_by_group: list[list[int] | None] = [None] * self.num_groups
        longest = 0
        while True:
            current = hit_length
            for spec, group_ids, cls in self.attention_groups:
                cached = hits_by_group[group_ids[0]]
                if isinstance(spec, FullAttentionSpec) and cached is not None:
                    # Downward closed: keep a prefix of the first round's blocks.
                    current = current // spec.block_size * spec.block_size
                    continue
                hits = cls.find_longest_cache_hit(
                    hashes_at_block_size(block_hashes, self.hash_block_size, spec.block_size),
                    current,
                    group_ids,
                    self.pool,
                    spec,
                    self.lcm_block_size,
                )
                current = len(hits[0]) * spec.block_size
                longest = max(longest, current)
                for group_id, blocks in zip(group_ids, hits, strict=True):
                    hits_by_group[group_id] = blocks
            if current >= hit_length:
                break
            hit_length = current
            if self._single_round:
                break
        for spec, group_ids, _ in self.attention_groups:
            if not isinstance(spec, FullAttentionSpec):
                break
            keep = hit_length // spec.block_size
            for group_id in group_ids:
                group_hits = hits_by_group[group_id]
                if group_hits is not None:
                    del group_hits[keep:]
        # A group that matched further than all of them: the prefix is shared but a
        # window group has not cached it (yet): the admission keeps its junction.
        self.last_junction = longest if longest > hit_length else 0
        return tuple(b if b is not None else [] for b in hits_by_group), hit_length


def make_coordinator(
    specs: Sequence[KVCacheSpec],
    pool: BlockPool,
    *,
    enable_caching: bool,
    hash_block_size: int,
) -> KVCacheCoordinator:
    """The coordinator variant for the groups and the caching setting."""
    if not enable_caching or not specs:
        return NoPrefixCacheCoordinator(
            specs, pool, enable_caching=False, hash_block_size=hash_block_size
        )
    if len(specs) == 1:
        return UnitaryCoordinator(specs, pool, enable_caching=True, hash_block_size=hash_block_size)
    return HybridCoordinator(specs, pool, enable_caching=True, hash_block_size=hash_block_size)
