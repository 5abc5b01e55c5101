"""vLLM's scheduler with kvsvc as its KV cache manager.

``KvsvcScheduler`` is vLLM's own scheduler (or, with async scheduling, its
``AsyncScheduler``) with one change: after vLLM builds it, its ``kv_cache_manager`` is
replaced by :class:`KvsvcKVCacheManager`, which answers every call vLLM's scheduler makes
of its manager from a kvsvc pool (see :mod:`kvsvc.integrations.vllm.manager` for how the
answers stay exact without a round trip per call). Scheduling itself (budgets, chunking,
preemption order, outputs) is unchanged vLLM code.

Per step the adapter sends one Step RPC, without waiting for it: its reply is checked at
the start of the next step. Select it with ``vllm_kwargs`` or
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
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    KVCacheConfig,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from kvsvc.integrations.vllm import compat
from kvsvc.integrations.vllm.config import settings_from_additional_config
from kvsvc.integrations.vllm.manager import KvsvcError, KvsvcPoolReplica
from kvsvc.integrations.vllm.request_hashing import hashing_context
from kvsvc.integrations.vllm.specs import UnsupportedSpecError, kvsvc_spec_from_vllm
from kvsvc.specs import KVCacheConfig as KvsvcKVCacheConfig
from kvsvc.specs import KVCacheGroupSpec

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
        replica: the engine's replica of the pool (owns the connection).
        kv_cache_config: vLLM's KV cache config (the pool's plan, allocated by the workers).
        log_stats: whether vLLM collects prefix-cache stats.
        watermark: vLLM's admission watermark (fraction of blocks kept free).
        needs_zeroing: whether vLLM zeroes newly allocated blocks (it asks for their ids).
    """

    def __init__(
        self,
        replica: KvsvcPoolReplica,
        *,
        kv_cache_config: KVCacheConfig,
        log_stats: bool,
        watermark: float,
        needs_zeroing: bool,
    ) -> None:
        self.replica = replica
        self.kv_cache_config = kv_cache_config
        self.block_size = replica.block_size
        self.max_model_len = replica.max_model_len
        self.enable_caching = replica.enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self.coordinator = _CoordinatorDescription(
            tuple(
                _GroupDescription(i, group.kv_cache_spec, group.kv_cache_spec.block_size)
                for i, group in enumerate(kv_cache_config.kv_cache_groups)
            )
        )
        # Attention groups whose tables vLLM clips to the computed tokens.
        self._clipped_block_sizes = tuple(
            group.kv_cache_spec.block_size
            if isinstance(group.kv_cache_spec, AttentionSpec)
            and not isinstance(group.kv_cache_spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec))
            else 0
            for group in kv_cache_config.kv_cache_groups
        )
        self._needs_zeroing = needs_zeroing
        self._new_block_ids: list[int] = []
        null_block = KVCacheBlock(0)
        null_block.is_null = True
        self._block_objects: list[KVCacheBlock | None] = [None] * kv_cache_config.num_blocks
        self._block_objects[0] = null_block
        # The last lookup: (request id, hit tokens, hit blocks per group, hit cap),
        # consumed by its admission (which hands the server the same cap).
        self._lookup: tuple[str, int, tuple[list[int], ...], int | None] | None = None

    # -- blocks as vLLM's objects --------------------------------------------------------

    def _blocks(self, tables: Sequence[Sequence[int]]) -> KVCacheBlocks:
        if not any(tables):
            return self.empty_kv_cache_blocks
        objects = self._block_objects
        groups = []
        for block_ids in tables:
            out = []
            for block_id in block_ids:
                block = objects[block_id]
                if block is None:
                    block = objects[block_id] = KVCacheBlock(block_id)
                out.append(block)
            groups.append(out)
        return KVCacheBlocks(tuple(groups))

    def create_kv_cache_blocks(self, blocks: tuple[list[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # -- stats and drains ----------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.replica.usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and compat.prefix_cache_hit_limit(request) != 0

    def get_num_cached_tokens(self, request: Request) -> int:
        """vLLM 0.34's probe for cache-aware admission: the request's cached prefix, from
        the replica, touching nothing (as vLLM's, capped at all but the last token)."""
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        num_hit_tokens, _ = self.replica.lookup(
            request.all_token_ids, hashing_context(request, self.block_size)
        )
        return num_hit_tokens

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
        return [0] * self.num_kv_cache_groups

    def _note_new_blocks(self, tables: Sequence[Sequence[int]], skip: Sequence[int]) -> None:
        """Record newly allocated ids for vLLM to zero (past ``skip`` entries per group)."""
        if self._needs_zeroing:
            for table, first in zip(tables, skip, strict=True):
                self._new_block_ids.extend(b for b in table[first:] if b)

    # -- lookups and allocations ---------------------------------------------------------

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The cached prefix, from the replica (no RPC); ``max_cache_hit_length`` (vLLM
        0.33+) tightens the request's own cap."""
        cap = compat.max_cache_hit_tokens(request, max_cache_hit_length)
        if not self.enable_caching or cap == 0:
            self._lookup = (request.request_id, 0, (), cap)
            return self.empty_kv_cache_blocks, 0, 0
        num_hit_tokens, hits = self.replica.lookup(
            request.all_token_ids, hashing_context(request, self.block_size), cap
        )
        self._lookup = (request.request_id, num_hit_tokens, hits, cap)
        return self._blocks(hits), num_hit_tokens, 0

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

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

        Decided by the replica exactly as the server's copy of the pool will decide it;
        the operation is queued for the step's Step RPC.
        """
        if num_external_computed_tokens or delay_cache_blocks:
            raise KvsvcError("kvsvc's vLLM scheduler does not serve KV connectors")
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        replica = self.replica
        request_id = request.request_id
        if replica.cache.has_request(request_id):
            new = replica.allocate_running(
                request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                num_new_tokens,
                num_lookahead_tokens,
                request.num_in_flight_tokens,
            )
            if new is None:
                return None
            self._note_new_blocks(new, [0] * len(new))
            return self._blocks(new)
        return self._admit(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            num_encoder_tokens,
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
        num_encoder_tokens: int,
        *,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> KVCacheBlocks | None:
        lookup = self._lookup
        self._lookup = None
        request_id = request.request_id
        cap = (
            lookup[3]
            if lookup is not None and lookup[0] == request_id
            else compat.max_cache_hit_tokens(request, None)
        )
        if num_hit_tokens:
            if lookup is None or lookup[0] != request_id or lookup[1] != num_hit_tokens:
                raise KvsvcError(
                    f"admission of {request_id!r} with {num_hit_tokens} cached tokens "
                    "that its lookup did not report"
                )
            hits: Sequence[Sequence[int]] = lookup[2]
        else:
            hits = tuple(() for _ in range(self.num_kv_cache_groups))
        replica = self.replica
        watermark = 0
        if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            watermark = self.watermark_blocks
        num_free = replica.num_free_blocks
        computed = min(request.num_computed_tokens + num_hit_tokens, self.max_model_len)
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            needed = replica.blocks_to_admit(request_id, full, hits, computed, num_encoder_tokens)
            if needed + watermark > num_free:
                return None
        num_slots = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        needed = replica.blocks_to_admit(request_id, num_slots, hits, computed, num_encoder_tokens)
        if needed + watermark > num_free - reserved_blocks:
            return None
        start = RequestStart(
            hashing=hashing_context(request, self.block_size),
            skip_prefix_cache_read=cap == 0,
            resumed=request.num_preemptions > 0,
            num_encoder_tokens=num_encoder_tokens,
            num_prompt_tokens=(
                request.num_prompt_tokens if request.num_tokens > request.num_prompt_tokens else 0
            ),
            max_cache_hit_tokens=None if cap == 0 else cap,
            # vLLM pads an admission with one token left to 1 + its drafts.
            num_draft_tokens=max(0, computed + num_new_tokens - request.num_tokens),
        )
        tables = replica.admit(
            request_id, request.all_token_ids, num_new_tokens, num_lookahead_tokens, start
        )
        if tables is None:
            return None
        self._note_new_blocks(tables, [len(group) for group in hits])
        return self._blocks(tables)

    def free(self, request: Request) -> None:
        self.replica.free(request.request_id, preempted=not request.is_finished())

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Outputs arrived after their slots (async scheduling, speculative decoding):
        the pool caches the request's blocks up to ``num_computed_tokens``, as vLLM's."""
        if self.enable_caching:
            self.replica.cache_outputs(
                request.request_id,
                request.all_token_ids,
                request.num_computed_tokens,
                num_computed_tokens,
            )

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """vLLM calls this only for KV connectors, which kvsvc's scheduler refuses: the
        pool drops out-of-window blocks itself as each allocation advances the request."""

    # -- tables --------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self._blocks(self.replica.tables(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(table) for table in self.replica.tables(request_id))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        return tuple(
            list(table[: -(-num_computed_tokens // size)]) if size else list(table)
            for table, size in zip(
                self.replica.tables(request_id), self._clipped_block_sizes, strict=True
            )
        )

    def estimate_cached_tokens(self, request: Request) -> int:
        return self.replica.cached_tokens(request.request_id)

    def reset_prefix_cache(self) -> bool:
        if not self.replica.reset_prefix_cache():
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


# Group kinds vLLM's CPU backend cannot run here, so kvsvc has not checked them against
# stock vLLM end to end: refused until a GPU run does.
_UNVERIFIED_KINDS = {
    "MambaSpec": "Mamba state groups (vLLM's CPU backend has no Mamba kernels to check them "
    "against stock vLLM; they need a GPU run)",
    "CrossAttentionSpec": "cross-attention groups of encoder-decoder models (not yet checked "
    "against stock vLLM)",
}


def _check_supported(scheduler: Scheduler, kv_cache_config: KVCacheConfig) -> None:
    for group in kv_cache_config.kv_cache_groups:
        reason = _UNVERIFIED_KINDS.get(type(group.kv_cache_spec).__name__)
        if reason is not None:
            raise KvsvcError(f"kvsvc's vLLM scheduler does not serve {reason} yet")
    if scheduler.connector is not None:
        raise KvsvcError("kvsvc's vLLM scheduler does not support KV connectors")
    refusal = eagle_refusal(
        bool(getattr(scheduler, "use_eagle_block_drop", False)),
        compat.num_hash_lookahead_tokens(scheduler.vllm_config),
        int(getattr(scheduler.vllm_config, "num_prefill_lookahead_tokens", 0) or 0),
    )
    if refusal:
        raise KvsvcError(refusal)


def eagle_refusal(
    drops_block: bool, num_hash_lookahead_tokens: int, num_prefill_lookahead_tokens: int = 0
) -> str:
    """Why kvsvc refuses an EAGLE/MTP configuration ("" when it serves it).

    EAGLE-style drafters build a position's draft KV from the next token as well, so
    vLLM keeps a hit's trailing block out of reach: it drops the last matched block
    (``use_eagle_block_drop``), or from 0.33 makes each block's hash cover the next
    tokens (``num_hash_lookahead_tokens``); multi-module MTP also leaves its last
    ``num_prefill_lookahead_tokens - 1`` tokens uncached (their KV is re-prefilled).
    kvsvc's pool models none of these yet, so its hits would differ from stock vLLM's:
    refused, naming the settings that turn them off (vLLM then warns that acceptance
    rates may drop) or the drafters kvsvc serves.
    """
    if num_prefill_lookahead_tokens > 1:
        return (
            f"kvsvc's vLLM scheduler does not serve multi-module MTP with prefix caching: "
            f"vLLM re-prefills each request's last {num_prefill_lookahead_tokens - 1} "
            "tokens and caches them later, which kvsvc's pool does not model yet. Use one "
            "MTP module (num_speculative_tokens 1) or an EAGLE, draft-model or n-gram "
            "drafter, or run without prefix caching"
        )
    if not drops_block and not num_hash_lookahead_tokens:
        return ""
    what = (
        f"hashes blocks with the {num_hash_lookahead_tokens} token(s) after them"
        if num_hash_lookahead_tokens
        else "drops the last block of every prefix-cache hit"
    )
    return (
        f"kvsvc's vLLM scheduler does not serve EAGLE/MTP speculative decoding with prefix "
        f"caching as this vLLM runs it: it {what}, which kvsvc's pool does not model yet. "
        'Turn both off in --speculative-config: {"disable_eagle_block_drop": true, '
        '"disable_lookahead_block_hashes": true} (vLLM 0.33+; 0.32 has only the first), '
        "use a draft-model or n-gram drafter, or run without prefix caching"
    )


def replica_config(kv_cache_config: KVCacheConfig) -> KvsvcKVCacheConfig:
    """vLLM's KV cache groups as kvsvc's scheduler config (one spec per group).

    Raises:
        KvsvcError: a group kvsvc cannot represent (naming it).
    """
    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        try:
            spec = kvsvc_spec_from_vllm(f"group {i}", group.kv_cache_spec)
        except UnsupportedSpecError as exc:
            raise KvsvcError(str(exc)) from None
        groups.append(KVCacheGroupSpec(list(group.layer_names), spec))
    return KvsvcKVCacheConfig(num_blocks=kv_cache_config.num_blocks, kv_cache_groups=groups)


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
        settings = settings_from_additional_config(self.vllm_config.additional_config)
        try:
            compat.check_version(
                compat.installed_version(), allow_untested=settings.allow_untested_vllm
            )
        except compat.UnsupportedVllmError as exc:
            raise KvsvcError(str(exc)) from None
        _check_supported(self, kv_cache_config)
        if self.enable_kv_cache_events:
            logger.warning(
                "vLLM's KV events are not published with kvsvc's scheduler: kvsvc publishes the "
                "pool's events in vLLM's format (kvsvc serve --kv-events-zmq ENDPOINT)"
            )
        replica = KvsvcPoolReplica(
            settings,
            config=replica_config(kv_cache_config),
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enable_caching=self.cache_config.enable_prefix_caching,
            hash_block_size=self.hash_block_size,
            prefix_cache_retention_interval=self.cache_config.prefix_cache_retention_interval,
        )
        # Replaces the manager vLLM built (its block pool is never used).
        self.kv_cache_manager = KvsvcKVCacheManager(
            replica,
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
    def kvsvc(self) -> KvsvcPoolReplica:
        """The pool's replica (its ``stats`` say what the manager cost)."""
        return self.kv_cache_manager.replica

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        replica = self.kv_cache_manager.replica
        # The previous step's reply: had vLLM's forward pass to arrive in.
        replica.await_reply()
        if replica.needs_resync:
            # The pool's KV data is gone (or the server answered otherwise than the
            # replica): preempt everything running, as vLLM does for a reset of the
            # prefix cache with running requests, and start again from the server's state.
            self.reset_prefix_cache(reset_running_requests=True)
        output = super().schedule(*args, **kwargs)
        replica.end_step()
        return output

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        outputs = super().update_from_output(*args, **kwargs)
        if not self.has_unfinished_requests():
            # Idle now: no schedule() may come to carry the frees of the requests that
            # just ended, so send them (and wait: nothing else is waiting meanwhile).
            self.kv_cache_manager.replica.flush()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        result = super().finish_requests(*args, **kwargs)
        if not self.has_unfinished_requests():
            self.kv_cache_manager.replica.flush()
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.kv_cache_manager.replica.close()


class KvsvcAsyncScheduler(KvsvcScheduler, AsyncScheduler):
    """vLLM's async scheduler on a kvsvc pool: outputs arrive a step after their slots and
    are sent to the pool then, so it caches the blocks they complete."""
