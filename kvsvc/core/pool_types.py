"""The values PoolKVCache's calls take and answer, and its record of an admission.

Plain data, apart from the facade so that its callers (the server's wire codecs and Step
batching, the vLLM adapter) and the facade's own parts (admission, the running-batch loop,
persistence) share one definition of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsvc.core.hashing import BlockHash, HashingContext
from kvsvc.errors import KvsvcError


@dataclass(frozen=True, slots=True)
class RequestStart:
    """What only a request's first ``allocate`` (admission or resumption) carries.

    Attributes:
        hashing: extra-key context of the prompt's block hashes.
        skip_prefix_cache_read: do not read the cache (prompt logprobs, all-token pooling);
            the request's blocks are still cached for others.
        resumed: re-admission after preemption (prefix stats count it apart).
        num_encoder_tokens: encoder input length, for cross-attention groups.
        num_prompt_tokens: of a resumed request's tokens, how many were its prompt (0:
            all of them); sparse window retention keeps the blocks before the prompt's
            end, where a resend of it can hit.
        max_cache_hit_tokens: at most this many leading tokens come from the prefix
            cache (vLLM's ``max_cache_hit_length``); None: all but the last token.
        num_draft_tokens: of the call's ``num_new_tokens``, draft slots beyond the tokens
            sent, scheduled on top of the prompt's part (vLLM pads a request that resumes
            with one token left to ``1 + drafts``).
    """

    hashing: HashingContext | None = None
    skip_prefix_cache_read: bool = False
    resumed: bool = False
    num_encoder_tokens: int = 0
    num_prompt_tokens: int = 0
    max_cache_hit_tokens: int | None = None
    num_draft_tokens: int = 0


@dataclass(slots=True, init=False)
class AllocateOutcome:
    """Result of one ``allocate``.

    Attributes:
        ok: False means NO_SPACE: the request's tokens and computed count are as they
            were (the engine preempts or waits); only blocks a window has passed may have
            been released (``released``), as vLLM releases them before it checks.
        new_block_ids: per group, the entries appended to the table by this call. On the
            first call that is the whole table: prefix hits, null padding (window groups),
            then new blocks. Later entries may hold the null id 0 (Mamba groups).
        num_null_blocks: per group, how many leading entries of the table are now the null
            block (sliding window, chunked local and Mamba groups drop blocks).
        num_cached_tokens: first call: tokens served from the prefix cache; otherwise 0.
        num_scheduled_tokens: tokens scheduled (would have been, when not ok).
        num_computed_tokens: the request's computed tokens after the call.
        recompute: the request's KV data is gone (:meth:`PoolKVCache.invalidate`):
            nothing changed (``ok`` is False); the engine frees it as preempted and
            admits it again.
        released: a NO_SPACE outcome released blocks that fell out of the request's
            window (its table's null counts grew): the pool changed after all.
    """

    ok: bool
    new_block_ids: tuple[list[int], ...]
    num_null_blocks: tuple[int, ...]
    num_cached_tokens: int
    num_scheduled_tokens: int
    num_computed_tokens: int
    recompute: bool = False
    released: bool = False

    def __init__(
        self,
        ok: bool,
        new_block_ids: tuple[list[int], ...],
        num_null_blocks: tuple[int, ...],
        num_cached_tokens: int,
        num_scheduled_tokens: int,
        num_computed_tokens: int,
        recompute: bool = False,
        released: bool = False,
    ) -> None:
        # Written out: a native constructor (kvsvc.core.events' note); one per allocate.
        self.ok = ok
        self.new_block_ids = new_block_ids
        self.num_null_blocks = num_null_blocks
        self.num_cached_tokens = num_cached_tokens
        self.num_scheduled_tokens = num_scheduled_tokens
        self.num_computed_tokens = num_computed_tokens
        self.recompute = recompute
        self.released = released


class RunningColumns:
    """Where :meth:`PoolKVCache.allocate_running` writes its per-operation results: one
    entry per operation of the Step (``num_operations``), operation ``i``'s at index ``i``.

    ``new_block_ids`` holds, per operation, the blocks appended to its (single group's)
    table, or the shared ``EMPTY`` list; ``errors`` maps an operation index to the error
    that rejected it (its other entries are then placeholders); ``recompute`` lists the
    operations refused because their request must be recomputed (``ok`` False). Until an
    operation is applied its entries are placeholders (not ok, 0, ``EMPTY``).
    """

    __slots__ = ("errors", "new_block_ids", "num_computed_tokens", "ok", "recompute")

    EMPTY: ClassVar[list[int]] = []  # shared; never mutated

    def __init__(self, num_operations: int) -> None:
        self.ok: list[bool] = [False] * num_operations
        self.num_computed_tokens: list[int] = [0] * num_operations
        self.new_block_ids: list[list[int]] = [self.EMPTY] * num_operations
        self.errors: dict[int, KvsvcError] = {}
        self.recompute: list[int] = []


@dataclass(frozen=True, slots=True)
class PreparedLookup:
    """A prompt's block hashes and hit cap (:meth:`PoolKVCache.prepare_lookup`).

    Attributes:
        block_hashes: the prompt's full-block hashes at the pool's hash block size.
        max_hit_tokens: the admission cap (one token is always computed).
        enabled: False when nothing can hit (caching off, or a prompt under 2 tokens).
    """

    block_hashes: list[BlockHash]
    max_hit_tokens: int
    enabled: bool


@dataclass(frozen=True, slots=True)
class BlockTableView:
    """A copy of one request's tables (null id 0 where blocks were dropped);
    ``needs_recompute``: its KV data is gone (see :meth:`PoolKVCache.invalidate`)."""

    groups: tuple[list[int], ...]
    num_computed_tokens: int
    num_tokens: int
    needs_recompute: bool = False


@dataclass(frozen=True, slots=True)
class AdmissionRecord:
    """What a live request's admission was called with and answered, kept until its next
    successful call so an identical retry (its reply was lost) can be answered again."""

    start: RequestStart
    num_new_tokens: int
    num_lookahead_tokens: int
    num_cached_tokens: int
    num_scheduled_tokens: int
