"""KVCacheManager: the scheduler-facing operations on one pool (vLLM's manager semantics).

The scheduler admits a request with ``get_computed_blocks`` + ``allocate_slots``, calls
``allocate_slots`` again every step it schedules the request, and ``free`` when the request
finishes or is preempted. This layer owns the pool, the coordinator and the hasher; it knows
nothing of request ids being valid or inputs being sane (the facade checks those).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableSequence, Sequence
from dataclasses import dataclass
from math import gcd, lcm
from typing import Any

from kvsvc.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvsvc.core.coordinator import KVCacheCoordinator, make_coordinator
from kvsvc.core.events import MEDIUM_GPU, KVEventBatch, KVEventQueue
from kvsvc.core.hashing import BlockHash, BlockHasher, HashingContext
from kvsvc.core.managers import representative_spec
from kvsvc.core.request import RequestState
from kvsvc.core.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
)
from kvsvc.core.stats import PrefixCacheStats
from kvsvc.core.window_managers import ChunkedLocalAttentionManager, SlidingWindowManager
from kvsvc.specs import CrossAttentionSpec, KVCacheConfig, KVCacheSpec, MambaSpec


@dataclass(slots=True, init=False)
class KVCacheBlocks:
    """Block ids per KV cache group: ``blocks[g][j]`` is group g's j-th block.

    The result type between the scheduler and the manager, hiding the manager's tables.
    """

    blocks: tuple[Sequence[int], ...]

    def __init__(self, blocks: tuple[Sequence[int], ...]) -> None:
        # Written out: a native constructor (kvsvc.core.events' note); several an allocate.
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(group) for group in self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple([*a, *b] for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def is_empty(self) -> bool:
        return not any(self.blocks)


def _supports_prefix_caching(spec: KVCacheSpec) -> bool:
    spec = representative_spec(spec)
    if isinstance(spec, CrossAttentionSpec):
        return False  # encoder states are per request
    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "none":
        return False  # one running state, overwritten in place
    return spec.participates_in_prefix_caching


def resolve_block_sizes(
    specs: Sequence[KVCacheSpec], hash_block_size: int | None, enable_caching: bool
) -> tuple[int, int]:
    """The scheduler block size (lcm of the groups') and the hash block size.

    One group hashes at its block size. Several groups hash at the gcd of their block sizes
    unless told otherwise; every group's block size must be a multiple of it so coarser
    groups can read the hashes through a block-size view.

    Raises:
        ValueError: a hash block size that does not divide every group's block size (or,
            for one group, differs from it).
    """
    sizes = [spec.block_size for spec in specs]
    if not sizes:
        return 1, hash_block_size or 1
    scheduler_block_size = lcm(*sizes)
    if hash_block_size is None:
        if not enable_caching:
            return scheduler_block_size, scheduler_block_size
        return scheduler_block_size, sizes[0] if len(sizes) == 1 else gcd(*sizes)
    if hash_block_size < 1:
        raise ValueError(f"hash_block_size must be >= 1, got {hash_block_size}")
    if enable_caching:
        if len(sizes) == 1 and hash_block_size != sizes[0]:
            raise ValueError(
                f"hash_block_size={hash_block_size}: with one KV cache group, hits land on its "
                f"block size ({sizes[0]}); unset it or set it to {sizes[0]}"
            )
        if any(size % hash_block_size for size in sizes):
            raise ValueError(
                f"hash_block_size={hash_block_size} must divide every group's block size {sizes}"
            )
    return scheduler_block_size, hash_block_size


class KVCacheManager:
    """Scheduler-side KV cache manager of one pool.

    Args:
        kv_cache_config: the scheduler's config: one spec per group; ``num_blocks``
            includes the null block.
        max_model_len: longest sequence a request may reach.
        enable_caching: prefix caching (forced off when a group cannot be cached: cross
            attention, Mamba without a cache mode).
        hash_algo: ``xxh3_128`` or ``sha256_cbor``.
        hash_seed: seed of the first block's parent (see :class:`BlockHasher`).
        hash_block_size: hashing granularity (see :func:`resolve_block_sizes`).
        enable_events: record KV events for ``take_events``.
        medium: medium named in events.
        prefix_cache_retention_interval: vLLM's setting of that name for sliding-window
            groups: None caches every full block (dense), 0 only the blocks a later hit
            can reach (vLLM's default), N > 0 also a window tail per N-token segment.
        index_shards: shards of each group's prefix index (see
            :class:`kvsvc.core.BlockPool`; None: by the pool's size).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "xxh3_128",
        hash_seed: str | None = None,
        hash_block_size: int | None = None,
        enable_events: bool = False,
        medium: str = MEDIUM_GPU,
        prefix_cache_retention_interval: int | None = None,
        index_shards: int | None = None,
    ) -> None:
        specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = (
            enable_caching and bool(specs) and all(_supports_prefix_caching(spec) for spec in specs)
        )
        self.block_size, self.hash_block_size = resolve_block_sizes(
            specs, hash_block_size, self.enable_caching
        )
        # The hasher validates the algorithm name even when caching is off.
        hasher = BlockHasher(hash_algo, self.hash_block_size, hash_seed)
        self.hasher: BlockHasher | None = hasher if self.enable_caching else None
        self.hash_algo = hasher.algo
        self.hash_seed = hasher.seed
        self.events: KVEventQueue | None = KVEventQueue() if enable_events else None
        self.group_kinds = [representative_spec(spec).kind.value for spec in specs]
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching=self.enable_caching,
            num_groups=max(1, len(specs)),
            group_kinds=self.group_kinds or ["unknown"],
            events=self.events,
            medium=medium,
            index_shards=index_shards,
        )
        self.coordinator: KVCacheCoordinator = make_coordinator(
            specs,
            self.block_pool,
            enable_caching=self.enable_caching,
            hash_block_size=self.hash_block_size,
        )
        self.num_kv_cache_groups = len(specs)
        interval = prefix_cache_retention_interval
        if interval is not None and (interval < 0 or interval % self.block_size):
            raise ValueError(
                "prefix_cache_retention_interval must be >= 0 and a multiple of the block "
                f"size {self.block_size}, got {interval}"
            )
        self.prefix_cache_retention_interval = interval
        for window_manager in self.coordinator.managers:
            if isinstance(window_manager, SlidingWindowManager):
                window_manager.retention_interval = interval
                window_manager.alignment_tokens = self.block_size
        self.prefix_cache_stats = PrefixCacheStats()
        self._empty_blocks: tuple[Sequence[int], ...] = tuple(() for _ in specs)
        # Shortcuts for running requests: one full-attention group, or attention groups
        # with plain tables (no Mamba state juggling, no cross attention).
        managers = self.coordinator.managers
        self._running_marker: dict[str, int] | None = (
            managers[0].num_cached_block if managers else None
        )
        self._plain_group: SingleTypeKVCacheManager | None = (
            managers[0]
            if len(managers) == 1 and type(managers[0]) is FullAttentionManager
            else None
        )
        plain_tables = (
            FullAttentionManager,
            SinkFullAttentionManager,
            SlidingWindowManager,
            ChunkedLocalAttentionManager,
        )
        self._windowed_groups: tuple[SingleTypeKVCacheManager, ...] | None = (
            managers if managers and all(type(m) in plain_tables for m in managers) else None
        )
        self._block_sizes = tuple(m.block_size for m in managers)
        self._dropping_indexes = tuple(i for i, m in enumerate(managers) if m.may_drop_blocks)
        # request id -> its tables (the managers' lists), for the windowed shortcut.
        self._tables: dict[str, tuple[list[int], ...]] = {}

    # -- requests ------------------------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        token_ids: MutableSequence[int],
        *,
        hashing: HashingContext | None = None,
        skip_reading_prefix_cache: bool = False,
        resumed: bool = False,
        num_encoder_tokens: int = 0,
        packed_token_ids: bytes | None = None,
    ) -> RequestState:
        """A request state hashed with this pool's hasher (no hashes when caching is off)."""
        return RequestState(
            request_id,
            token_ids,
            hasher=self.hasher,
            hashing=hashing,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            resumed=resumed,
            num_encoder_tokens=num_encoder_tokens,
            packed_token_ids=packed_token_ids,
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(
        self,
        request: RequestState,
        *,
        record_stats: bool = True,
        max_cache_hit_tokens: int | None = None,
    ) -> tuple[KVCacheBlocks, int]:
        """The cached prefix of a request being admitted.

        The hit is capped at ``num_tokens - 1``: the last token must be computed to get
        logits. That can cost a whole block, since hits are block aligned.
        ``max_cache_hit_tokens`` lowers the cap (vLLM's ``max_cache_hit_length``).

        Returns:
            The hit blocks per group and the hit length in tokens (0 when caching is off or
            the request must not read the cache).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return KVCacheBlocks(self._empty_blocks), 0
        max_length = request.num_tokens - 1
        if max_cache_hit_tokens is not None and max_cache_hit_tokens < max_length:
            max_length = max_cache_hit_tokens
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_length
        )
        request.shared_prefix_boundary = self.coordinator.last_junction
        if record_stats:
            self.record_prefix_lookup(request, num_hit_tokens)
        return KVCacheBlocks(hits), num_hit_tokens

    def record_prefix_lookup(self, request: RequestState, num_hit_tokens: int) -> None:
        """Count one admission's lookup in the prefix-cache stats."""
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens, request.resumed)

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash], max_length: int) -> int:
        """Hit length for hashes and a length cap, touching nothing (routers' lookup)."""
        if not self.enable_caching or max_length <= 0:
            return 0
        return self.coordinator.find_longest_cache_hit(block_hashes, max_length)[1]

    def allocate_slots(
        self,
        request: RequestState,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for its next tokens; None (and nothing changed) if short.

        Token layout of the request::

            | comp | new_comp | ext_comp | new | lookahead |
                                       |<- computed now ->|
                   |<-------- to be allocated ---------->|
                   |<- to be cached (known tokens only) ->|

        ``comp`` = ``request.num_computed_tokens``; ``new_comp`` = prefix-hit tokens
        (``new_computed_blocks``); ``ext_comp`` = tokens a connector supplies; ``new`` =
        tokens computed this step, drafts included; ``lookahead`` = slots for a drafter.

        Blocks that fell out of the attention window are freed first (so the tail of the
        request can reuse them), but only once the allocation is sure to succeed: a refusal
        leaves every table, reference count and the free queue exactly as they were.

        Args:
            request: the request.
            num_new_tokens: tokens to compute this step (drafts included).
            num_new_computed_tokens: prefix-hit tokens found by ``get_computed_blocks``.
            new_computed_blocks: the hit blocks.
            num_lookahead_tokens: extra slots for speculative decoding.
            num_external_computed_tokens: computed tokens loaded by a connector.
            delay_cache_blocks: do not cache yet (blocks being received).
            num_encoder_tokens: encoder input tokens (cross attention; first call).

        Returns:
            The entries appended to each group's table, or None when the pool is short.
        """
        block_ids = self.allocate_block_ids(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
        )
        return None if block_ids is None else KVCacheBlocks(block_ids)

    def allocate_block_ids(
        self,
        request: RequestState,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        num_in_flight_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """``allocate_slots`` returning the bare per-group lists (one object less per call).

        ``num_in_flight_tokens``: of the computed tokens, those whose KV earlier steps
        still write (async scheduling); out-of-window blocks are freed only below them.
        """
        if (
            new_computed_blocks is None
            and not num_external_computed_tokens
            and self._running_marker is not None
            and request.request_id in self._running_marker
        ):
            if self._plain_group is not None:
                return self._allocate_running_plain(
                    request, num_new_tokens, num_lookahead_tokens, delay_cache_blocks
                )
            if self._windowed_groups is not None:
                return self._allocate_running_windowed(
                    request,
                    num_new_tokens,
                    num_lookahead_tokens,
                    delay_cache_blocks,
                    num_in_flight_tokens,
                )
        coordinator = self.coordinator
        request_id = request.request_id
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks else self._empty_blocks
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        max_model_len = self.max_model_len
        total_computed = min(num_local_computed + num_external_computed_tokens, max_model_len)
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, max_model_len)
        # Blocks out of a window are freed on the processed-token basis (vLLM's).
        processed = max(0, total_computed - num_in_flight_tokens)

        # Before the check and before allocating, as vLLM does: blocks the window passed
        # go back to the free queue even when the allocation then fails (so the order
        # they are freed in, ahead of a preempted request's, is vLLM's), and fewer cached
        # blocks get evicted.
        coordinator.remove_skipped_blocks(request_id, processed)
        num_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hit_blocks,
            num_encoder_tokens,
            num_local_computed + num_external_computed_tokens,
            num_tokens_main_model,
        )
        if num_to_allocate > self.block_pool.free_queue.num_free_blocks:
            return None
        if not coordinator.is_running(request_id):
            # First allocation: start the tables with the prefix hits (touched) and blocks
            # for external tokens. A running request never gets either.
            coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, num_local_computed, num_external_computed_tokens
            )
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
        )
        if self.enable_caching and not delay_cache_blocks:
            # Drafts may be rejected: cache only tokens already known.
            coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        return new_blocks

    def _allocate_running_windowed(
        self,
        request: RequestState,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        num_in_flight_tokens: int,
    ) -> tuple[list[int], ...] | None:
        # A running request of a pool whose groups are all attention with plain tables
        # (full, sink, sliding window, chunked local): the general path without the per-group
        # dispatch layers. Same arithmetic, same order of operations.
        managers = self._windowed_groups
        assert managers is not None
        request_id = request.request_id
        tables = self._tables.get(request_id)
        if tables is None:
            tables = self._tables[request_id] = tuple(m.req_to_blocks[request_id] for m in managers)
        max_model_len = self.max_model_len
        total_computed = request.num_computed_tokens
        if total_computed > max_model_len:
            total_computed = max_model_len
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        counts = []
        num_to_allocate = 0
        for block_size, table in zip(self._block_sizes, tables):  # noqa: B905  # same length
            count = -(-num_tokens_need_slot // block_size) - len(table)
            counts.append(count)
            if count > 0:
                num_to_allocate += count
        processed = total_computed - num_in_flight_tokens
        if processed < 0:
            processed = 0
        # Released before the check, as the general path (and vLLM) releases them.
        for i in self._dropping_indexes:
            # Only call out when the window passed a block that is not null yet.
            manager = managers[i]
            table = tables[i]
            skipped = min(
                manager.get_num_skipped_tokens(processed) // manager.block_size, len(table)
            )
            if skipped > 0 and table[skipped - 1] != NULL_BLOCK_ID:
                manager.remove_skipped_blocks(request_id, processed)
        if num_to_allocate and num_to_allocate > self.block_pool.free_queue.num_free_blocks:
            return None
        new_blocks: list[list[int]] = []
        if num_to_allocate:
            get_new_blocks = self.block_pool.get_new_blocks
            for table, count in zip(tables, counts):  # noqa: B905  # same length
                if count > 0:
                    blocks = get_new_blocks(count)
                    table.extend(blocks)
                    new_blocks.append(blocks)
                else:
                    new_blocks.append([])
        else:
            new_blocks = [[] for _ in tables]
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = num_tokens_main_model
            if num_to_cache > request.num_tokens:
                num_to_cache = request.num_tokens
            for manager in managers:
                if num_to_cache // manager.block_size > manager.num_cached_block[request_id]:
                    manager.cache_blocks(request, num_to_cache)
        return tuple(new_blocks)

    def _allocate_running_plain(
        self,
        request: RequestState,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> tuple[list[int], ...] | None:
        # The decode step of a one-group full-attention pool: no window to slide, no hits,
        # usually no block boundary crossed. Same arithmetic as the general path.
        manager = self._plain_group
        assert manager is not None
        request_id = request.request_id
        table = manager.req_to_blocks[request_id]
        max_model_len = self.max_model_len
        total_computed = request.num_computed_tokens
        if total_computed > max_model_len:
            total_computed = max_model_len
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        block_size = manager.block_size
        num_new = -(-num_tokens_need_slot // block_size) - len(table)
        if num_new > 0:
            if num_new > self.block_pool.free_queue.num_free_blocks:
                return None
            new_blocks = self.block_pool.get_new_blocks(num_new)
            table.extend(new_blocks)
        else:
            new_blocks = []
        if self.enable_caching and not delay_cache_blocks:
            num_to_cache = num_tokens_main_model
            if num_to_cache > request.num_tokens:
                num_to_cache = request.num_tokens
            if num_to_cache // block_size > manager.num_cached_block[request_id]:
                manager.cache_blocks(request, num_to_cache)
        return (new_blocks,)

    def cache_blocks(self, request: RequestState, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_computed_tokens`` (delayed caching)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: RequestState | str) -> None:
        """Release a request's blocks, each table tail first (tails are evicted first)."""
        request_id = request if isinstance(request, str) else request.request_id
        self.coordinator.free(request_id)
        self._tables.pop(request_id, None)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Replace blocks outside the attention window with the null block and free them."""
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks shared by every request holding blocks.

        May be 0 although all *scheduled* requests share a prefix: requests that hold blocks
        but are not scheduled this step count too.
        """
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix index (held blocks stay held)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix index; False (and nothing changed) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> KVEventBatch | None:
        """Events since the last call as one numbered batch, or None if there were none."""
        return self.events.take() if self.events is not None else None

    def take_event_batches(self) -> list[KVEventBatch]:
        """Events since the last call as numbered batches of bounded size (see
        :meth:`KVEventQueue.take_batches`); empty if there were none."""
        return self.events.take_batches() if self.events is not None else []

    # -- state (persistence) -------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """The pool, every group's own state and the prefix-cache stats (requests' entries
        are the facade's to write, see :meth:`PoolKVCache.to_state`)."""
        stats = self.prefix_cache_stats
        return {
            "block_pool": self.block_pool.to_state(),
            "groups": [m.to_state() for m in self.coordinator.managers],
            "prefix_cache_stats": [
                stats.requests,
                stats.queries,
                stats.hits,
                stats.preempted_requests,
                stats.preempted_queries,
                stats.preempted_hits,
            ],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over :meth:`to_state` (requests' entries are loaded by the facade).

        Raises:
            ValueError: a state of another shape.
        """
        managers = self.coordinator.managers
        if len(state["groups"]) != len(managers):
            raise ValueError(
                f"the state has {len(state['groups'])} KV cache groups, this pool {len(managers)}"
            )
        self.block_pool.load_state(state["block_pool"])
        for manager, group_state in zip(managers, state["groups"], strict=True):
            manager.load_state(group_state)
        self._tables.clear()
        (
            self.prefix_cache_stats.requests,
            self.prefix_cache_stats.queries,
            self.prefix_cache_stats.hits,
            self.prefix_cache_stats.preempted_requests,
            self.prefix_cache_stats.preempted_queries,
            self.prefix_cache_stats.preempted_hits,
        ) = state["prefix_cache_stats"]
