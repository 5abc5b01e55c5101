"""vLLM's scheduler with kvsvc as its KV cache manager.

``KvsvcScheduler`` is vLLM's own scheduler (or, with async scheduling, its
``AsyncScheduler``) with one change: after vLLM builds it, its ``kv_cache_manager`` is
replaced by :class:`KvsvcKVCacheManager`, which answers every call vLLM's scheduler makes
of its manager from a kvsvc pool (see :mod:`kvsvc.integrations.vllm.manager` for how the
answers stay exact without a round trip per call). Scheduling itself (budgets, chunking,
preemption order, outputs) is unchanged vLLM code.

Per step the adapter sends one Step RPC (without waiting for it) plus one synchronous Step
per admission (the prefix lookup). Select it with ``vllm_kwargs`` or
``--scheduler-cls kvsvc.integrations.vllm.scheduler.KvsvcScheduler``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsvc_client import RequestStart
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvsvc.integrations.vllm.config import settings_from_additional_config
from kvsvc.integrations.vllm.manager import (
    KvsvcBlockMirror,
    KvsvcError,
    hashing_context,
)

logger = logging.getLogger(__name__)

__all__ = ["KvsvcAsyncScheduler", "KvsvcError", "KvsvcKVCacheManager", "KvsvcScheduler"]


@dataclass(frozen=True)
class _GroupDescription:
    """What vLLM's engine core reads of a manager's per-group managers (metadata only)."""

    kv_cache_group_id: int
    kv_cache_spec: Any
    block_size: int


@dataclass(frozen=True)
class _CoordinatorDescription:
    """Read-only stand-in for ``KVCacheManager.coordinator``: the engine core and event
    metadata read the groups' block sizes and specs from it; kvsvc owns the blocks."""

    single_type_managers: tuple[_GroupDescription, ...]
    enable_partial_hash_hits: bool = False
    eagle_group_ids: tuple[int, ...] = ()
    num_reprefillable_tokens: int = 0


class KvsvcKVCacheManager:
    """The calls vLLM's scheduler makes of ``KVCacheManager``, answered by a kvsvc pool.

    Args:
        mirror: the pool's engine-side mirror (owns the connection).
        kv_cache_config: vLLM's KV cache config (the pool's plan, allocated by the workers).
        log_stats: whether vLLM collects prefix-cache stats.
        watermark: vLLM's admission watermark (fraction of blocks kept free).
        needs_zeroing: whether vLLM zeroes newly allocated blocks (it asks for their ids).
    """

    def __init__(
        self,
        mirror: KvsvcBlockMirror,
        *,
        kv_cache_config: KVCacheConfig,
        log_stats: bool,
        watermark: float,
        needs_zeroing: bool,
    ) -> None:
        self.mirror = mirror
        self.kv_cache_config = kv_cache_config
        self.block_size = mirror.block_size
        self.max_model_len = mirror.max_model_len
        self.enable_caching = mirror.enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = 1
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.empty_kv_cache_blocks = KVCacheBlocks(((),))
        self.coordinator = _CoordinatorDescription(
            tuple(
                _GroupDescription(i, group.kv_cache_spec, group.kv_cache_spec.block_size)
                for i, group in enumerate(kv_cache_config.kv_cache_groups)
            )
        )
        self._needs_zeroing = needs_zeroing
        self._new_block_ids: list[int] = []
        self._block_objects: list[KVCacheBlock | None] = [None] * kv_cache_config.num_blocks
        # The last lookup: (request id, hit blocks, hit tokens), consumed by its admission.
        self._lookup: tuple[str, list[int], int] | None = None

    # -- blocks as vLLM's objects --------------------------------------------------------

    def _blocks(self, block_ids: Sequence[int]) -> KVCacheBlocks:
        if not block_ids:
            return self.empty_kv_cache_blocks
        objects = self._block_objects
        out = []
        for block_id in block_ids:
            block = objects[block_id]
            if block is None:
                block = objects[block_id] = KVCacheBlock(block_id)
            out.append(block)
        return KVCacheBlocks((out,))

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- stats and drains ----------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.mirror.usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0
        )

    def new_step_starts(self) -> None:
        """Nothing per step: the adapter sends its Step when the step's schedule is built."""

    def take_events(self) -> list[Any]:
        """None here: kvsvc publishes the pool's events (``kvsvc serve --kv-events-zmq``)."""
        return []

    def take_new_block_ids(self) -> list[int]:
        ids = self._new_block_ids
        self._new_block_ids = []
        return ids

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[KVCacheBlock]]:
        return [], []  # copy-on-write only serves partial-block hits, which kvsvc has not

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}  # Mamba "align" states only

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]

    # -- lookups and allocations ---------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix (one synchronous Step carrying the step's queued operations)."""
        if not self.prefix_cache_lookup_enabled(request):
            self._lookup = (request.request_id, [], 0)
            return self.empty_kv_cache_blocks, 0, 0
        num_hit_tokens, hits = self.mirror.lookup(
            request.all_token_ids, hashing_context(request, self.block_size)
        )
        self._lookup = (request.request_id, hits, num_hit_tokens)
        return self._blocks(hits), num_hit_tokens, 0

    def get_computed_blocks_for_connector(
        self, request: Request
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        return (*self.get_computed_blocks(request), False)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """vLLM's ``allocate_slots``: the new blocks, or None when they do not fit.

        Decided from the mirror exactly as vLLM's manager decides it; the operation is
        queued for the step's Step RPC.
        """
        if num_external_computed_tokens or delay_cache_blocks or num_encoder_tokens:
            raise KvsvcError(
                "kvsvc's vLLM scheduler does not serve KV connectors or encoder-decoder models"
            )
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        mirror = self.mirror
        request_id = request.request_id
        if request_id in mirror.requests:
            new = mirror.allocate_running(
                request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                num_new_tokens,
                num_lookahead_tokens,
            )
            if new is None:
                return None
            if new and self._needs_zeroing:
                self._new_block_ids.extend(new)
            return self._blocks(new)
        return self._admit(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks,
            has_scheduled_reqs=has_scheduled_reqs,
        )

    def _admit(
        self,
        request: Request,
        num_new_tokens: int,
        num_hit_tokens: int,
        num_lookahead_tokens: int,
        *,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> KVCacheBlocks | None:
        lookup = self._lookup
        self._lookup = None
        if num_hit_tokens:
            if lookup is None or lookup[0] != request.request_id or lookup[2] != num_hit_tokens:
                raise KvsvcError(
                    f"admission of {request.request_id!r} with {num_hit_tokens} cached tokens "
                    "that its lookup did not report"
                )
            hits = lookup[1]
        else:
            hits = []
        mirror = self.mirror
        watermark = 0
        if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            watermark = self.watermark_blocks
        computed = min(request.num_computed_tokens + num_hit_tokens, self.max_model_len)
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if mirror.blocks_needed_to_admit(full, hits) + watermark > mirror.num_free_blocks:
                return None
        num_slots = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        needed = mirror.blocks_needed_to_admit(num_slots, hits)
        if needed + watermark > mirror.num_free_blocks - reserved_blocks:
            return None
        start = RequestStart(
            hashing=hashing_context(request, self.block_size),
            skip_prefix_cache_read=bool(request.skip_reading_prefix_cache),
            resumed=request.num_preemptions > 0,
        )
        new = mirror.admit(
            request.request_id,
            request.all_token_ids,
            hits,
            num_hit_tokens,
            num_new_tokens,
            num_lookahead_tokens,
            start,
        )
        if new and self._needs_zeroing:
            self._new_block_ids.extend(new)
        return self._blocks(new)

    def free(self, request: Request) -> None:
        self.mirror.free(request.request_id, preempted=not request.is_finished())

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Async scheduling delivers outputs after their slots: send them to be cached."""
        if self.enable_caching:
            self.mirror.append_tokens(request.request_id, request.all_token_ids)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Full attention keeps every block: nothing to remove."""

    # -- tables --------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self._blocks(self.mirror.table(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (list(self.mirror.table(request_id)),)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        table = self.mirror.table(request_id)
        return (list(table[: -(-num_computed_tokens // self.block_size)]),)

    def estimate_cached_tokens(self, request: Request) -> int:
        return self.mirror.cached_tokens(request.request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.mirror.reset_prefix_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    # -- what kvsvc's adapter does not serve ---------------------------------------------

    def _unsupported(self, what: str) -> KvsvcError:
        return KvsvcError(f"kvsvc's vLLM scheduler does not support {what}")

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        raise self._unsupported("deferred block frees (KV connectors)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        raise self._unsupported("evicting blocks by id (KV connectors)")

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> Any:
        raise self._unsupported("KV connectors")

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        raise self._unsupported("KV connectors")

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        return []


def _check_supported(scheduler: Scheduler, kv_cache_config: KVCacheConfig) -> None:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        raise KvsvcError(
            "kvsvc's vLLM scheduler serves models with one full-attention KV cache group; "
            f"this model has: {kinds}"
        )
    if scheduler.connector is not None:
        raise KvsvcError("kvsvc's vLLM scheduler does not support KV connectors")
    if scheduler.hash_block_size != scheduler.block_size:
        raise KvsvcError(
            f"kvsvc's vLLM scheduler needs hash_block_size == block_size "
            f"({scheduler.hash_block_size} != {scheduler.block_size})"
        )


class KvsvcScheduler(Scheduler):
    """vLLM's scheduler on a kvsvc pool (async scheduling picks :class:`KvsvcAsyncScheduler`)."""

    kv_cache_manager: KvsvcKVCacheManager  # type: ignore[assignment]

    def __new__(cls, *args: Any, **kwargs: Any) -> KvsvcScheduler:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if (
            cls is KvsvcScheduler
            and vllm_config is not None
            and vllm_config.scheduler_config.async_scheduling
        ):
            cls = KvsvcAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kv_cache_config: KVCacheConfig = self.kv_cache_config
        _check_supported(self, kv_cache_config)
        settings = settings_from_additional_config(self.vllm_config.additional_config)
        if self.enable_kv_cache_events:
            logger.warning(
                "vLLM's KV events are not published with kvsvc's scheduler: kvsvc publishes the "
                "pool's events in vLLM's format (kvsvc serve --kv-events-zmq ENDPOINT)"
            )
        mirror = KvsvcBlockMirror(
            settings,
            num_blocks=kv_cache_config.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enable_caching=self.cache_config.enable_prefix_caching,
        )
        # Replaces the manager vLLM built (its block pool is never used).
        self.kv_cache_manager = KvsvcKVCacheManager(
            mirror,
            kv_cache_config=kv_cache_config,
            log_stats=self.log_stats,
            watermark=self.scheduler_config.watermark,
            needs_zeroing=self.needs_kv_cache_zeroing,
        )
        logger.info(
            "KV cache manager: kvsvc pool %r at %s (%d blocks of %d tokens)",
            settings.pool,
            settings.engine_target,
            kv_cache_config.num_blocks,
            self.block_size,
        )

    @property
    def kvsvc(self) -> KvsvcBlockMirror:
        """The pool's mirror (its ``stats`` say what the manager cost)."""
        return self.kv_cache_manager.mirror

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        self.kv_cache_manager.mirror.end_step()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            # Idle now: no schedule() may come to carry the frees of the requests that
            # just ended, so send them (and wait: nothing else is waiting meanwhile).
            self.kv_cache_manager.mirror.flush()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        result = super().finish_requests(*args, **kwargs)
        if not self.has_unfinished_requests():
            self.kv_cache_manager.mirror.flush()
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.kv_cache_manager.mirror.close()


class KvsvcAsyncScheduler(KvsvcScheduler, AsyncScheduler):
    """vLLM's async scheduler on a kvsvc pool: outputs arrive a step after their slots and
    are sent to the pool then, so it caches the blocks they complete."""
