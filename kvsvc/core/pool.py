"""PoolKVCache: the engine-facing facade of one pool, so the gRPC layer only translates.

It keeps what vLLM's scheduler keeps per request (tokens, computed-token count) and maps the
engine's moments onto the manager (DESIGN.md, "How an engine's scheduler maps onto
Allocate"):

=====================  ===================================================================
admit / resume         ``allocate(..., start=RequestStart(...))`` with the whole prompt:
                       hash, look up the cached prefix (capped so one token is computed),
                       schedule ``min(num_new_tokens, prompt - cached)`` tokens
continue a prefill     ``allocate(rid, [], chunk)``
decode step            ``allocate(rid, sampled, 1 + drafts)``: append, hash a completed
                       block, allocate when a block boundary is crossed
finish / preempt       ``free([rid])``: blocks back tail first; cached ones stay findable
=====================  ===================================================================

Every call validates its input before changing anything, and a ``NO_SPACE`` outcome
(``ok=False``) leaves the pool exactly as it was. Single-threaded: the server serialises
calls per pool (only :meth:`PoolKVCache.prepare_lookup` may run beside them).

Retries are safe where a lost reply would otherwise make them fail: an admission repeated
exactly (same id, prompt, start and counts) before the request's next call answers the
request's current state, and a ``free`` of a recently freed id succeeds with nothing freed.

The facade's parts live beside it, a module each: :mod:`~kvsvc.core.pool_base` (the fields
they all share: the parts take it, so none imports the facade), :mod:`~kvsvc.core.pool_types`
(what it takes and answers), :mod:`~kvsvc.core.pool_admission` (a request's first call),
:mod:`~kvsvc.core.pool_running` (the running-batch loop, inherited), :mod:`~kvsvc.core.pool_limits`
(the token bounds) and :mod:`~kvsvc.core.pool_state` (its state as plain values).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

from kvsvc.core.events import KVEventBatch
from kvsvc.core.hashing import (
    BlockExtraKeys,
    HashingContext,
    check_hashing_context,
    pack_token_ids,
    validate_token_ids,
)
from kvsvc.core.pool_admission import admit
from kvsvc.core.pool_limits import check_tokens_held, check_unscheduled
from kvsvc.core.pool_running import RunningBatchPool
from kvsvc.core.pool_state import (
    load_pool_state,
    pool_config_state,
    pool_from_state,
    pool_to_state,
)
from kvsvc.core.pool_types import (
    AllocateOutcome,
    BlockTableView,
    PreparedLookup,
    RequestStart,
)
from kvsvc.core.request import RequestState, num_unscheduled_tokens
from kvsvc.core.stats import UsageSnapshot
from kvsvc.errors import (
    InvalidArgument,
    NotFound,
    quoted,
)
from kvsvc.specs import KVCacheConfig

# The most links of the free queue's cached (LRU) region a page may follow before the
# ids it returns (FreeBlockQueue.page_walk): a page costs O(limit + this), never O(offset).
MAX_FREE_QUEUE_WALK = 65536


class PoolKVCache(RunningBatchPool):
    """One pool's KV cache manager with the engine-facing semantics of DESIGN.md's table.

    Single-threaded: the server serialises calls per pool.

    Args:
        config: the planner's scheduler config (one per-layer spec per group);
            ``num_blocks`` includes the null block.
        max_model_len: longest sequence (prompt + outputs) a request may reach.
        enable_caching: prefix caching (off by force when a group cannot be cached).
        hash_algo: ``"xxh3_128"`` (fast, secret random seed) or ``"sha256_cbor"``
            (vLLM-compatible hashes).
        hash_seed: seed of the first block's parent; persist :attr:`hash_seed` to keep
            hashes stable across restarts.
        hash_block_size: hashing granularity; defaults to the block size (one group) or
            the gcd of the groups' block sizes.
        max_num_batched_tokens: the engine's per-step token budget (recorded for capacity
            reporting; not enforced).
        enable_events: record KV events for :meth:`take_events`.
        event_medium: medium named in events.
        max_requests: live requests at most; an admission past it raises
            ResourceExhausted (None: no bound).
        max_tokens: tokens the live requests hold together (prompts and outputs so
            far); an admission or a call that would add past it raises ResourceExhausted
            (None: no bound). ``max_requests`` alone bounds the count, not the memory: a
            request admitted with no tokens scheduled holds its whole prompt with no block.
        max_unscheduled_tokens: tokens of the live requests not scheduled yet (a prompt's
            part beyond the tokens cached and scheduled, tokens appended and not
            computed), together; past it ResourceExhausted. An engine schedules what it
            admits (a chunked prefill leaves its later chunks): this bound is what keeps a
            client that admits prompts without scheduling them from filling
            ``max_tokens`` ahead of the engines whose requests run (None: no bound).
        recently_freed: how many freed request ids are remembered, oldest forgotten
            first, so that a retried ``free`` of one succeeds (see :meth:`free`).
        prefix_cache_retention_interval: which blocks of sliding-window groups are
            cached (see :class:`kvsvc.core.KVCacheManager`); None: every full block.
        index_shards: shards of each group's prefix index (a power of two up to 256;
            None: by the pool's size). Any count behaves alike; fewer, larger shards
            stall a call longer when one regrows (see :class:`kvsvc.core.BlockPool`).

    Raises:
        ValueError: an unknown ``hash_algo`` (listing the valid names), a
            ``hash_block_size`` that does not fit the groups, a bad ``max_model_len``,
            ``max_requests`` or ``recently_freed``, or a group kind without a manager.
    """

    # -- requests ------------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        new_token_ids: Sequence[int],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        start: RequestStart | None = None,
        *,
        num_rejected_tokens: int = 0,
        packed_token_ids: bytes | None = None,
        num_in_flight_tokens: int = 0,
    ) -> AllocateOutcome:
        """Admit, resume or continue a request and give it slots for this step.

        Args:
            request_id: the engine's request id.
            new_token_ids: first call: the whole prompt (plus outputs so far on resumption);
                later: tokens sampled since the last call.
            num_new_tokens: tokens computed this step (first call: the step's budget for
                the request; drafts included when speculating).
            num_lookahead_tokens: extra slots for a draft model (capped at max_model_len).
            start: present exactly on the first call (admission or resumption).
            num_rejected_tokens: drafts rejected since the last call, taken off the
                computed count before this step (speculative decoding).
            packed_token_ids: ``new_token_ids`` already validated and packed by
                :func:`kvsvc.core.hashing.unpack_token_ids` (the wire's compact form);
                spares checking and packing them again.
            num_in_flight_tokens: tokens of earlier steps whose outputs have not come
                back (async scheduling): their KV is still being written, so blocks
                that fell out of a window are freed only below computed - in-flight
                (vLLM's ``allocate_slots`` frees on that processed-token basis).

        Returns:
            The outcome; ``ok=False`` (NO_SPACE) changed nothing. A refused first call does
            not make the request live; a refused later call does not keep the new tokens.
            A first call for a live request that repeats its admission exactly (same
            prompt, ``start``, counts), with no successful call in between, is a retry
            whose reply was lost: it changes nothing and answers the request's state as
            the admission did (its whole table, cached and scheduled counts).

        Raises:
            InvalidArgument: bad counts, token ids or multimodal items, an empty prompt,
                or a length beyond max_model_len (on every call, however the tokens
                came); nothing changed.
            AlreadyExists: a first call for a live request that is not such a retry.
            ResourceExhausted: an admission while ``max_requests`` requests are live, or
                tokens past ``max_tokens``; nothing changed.
            NotFound: a later call for a request that is not live.
        """
        if num_new_tokens < 0:
            raise InvalidArgument("num_new_tokens", f"must be >= 0, got {num_new_tokens}")
        if num_lookahead_tokens < 0:
            raise InvalidArgument(
                "num_lookahead_tokens", f"must be >= 0, got {num_lookahead_tokens}"
            )
        if start is not None:
            if num_in_flight_tokens:
                raise InvalidArgument(
                    "num_in_flight_tokens", "must be 0 on a first call (nothing is in flight)"
                )
            return admit(
                self,
                request_id,
                new_token_ids,
                num_new_tokens,
                num_lookahead_tokens,
                start,
                packed_token_ids,
            )
        return self._continue(
            request_id,
            new_token_ids,
            num_new_tokens,
            num_lookahead_tokens,
            num_rejected_tokens,
            num_in_flight_tokens,
            packed_token_ids,
            cache_only=False,
        )

    def cache_outputs(
        self,
        request_id: str,
        new_token_ids: Sequence[int],
        *,
        num_rejected_tokens: int = 0,
        num_in_flight_tokens: int = 0,
        packed_token_ids: bytes | None = None,
    ) -> AllocateOutcome:
        """Outputs of a running request arrived after its slots were allocated: append
        them and index the blocks they complete (vLLM's ``cache_blocks`` from its
        scheduler's ``update_from_output``, under async scheduling or speculation).

        Allocates and frees nothing. Blocks are cached up to ``computed -
        num_in_flight_tokens`` (after ``num_rejected_tokens`` is taken off the computed
        count): a slot whose KV a later step is still writing, or that holds a rejected
        draft's KV, is never indexed.

        Raises:
            InvalidArgument: bad token ids or counts (nothing changed).
            NotFound: the request is not live.
        """
        return self._continue(
            request_id,
            new_token_ids,
            0,
            0,
            num_rejected_tokens,
            num_in_flight_tokens,
            packed_token_ids,
            cache_only=True,
        )

    def _continue(
        self,
        request_id: str,
        new_token_ids: Sequence[int],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        num_rejected_tokens: int,
        num_in_flight_tokens: int,
        packed_token_ids: bytes | None,
        *,
        cache_only: bool,
    ) -> AllocateOutcome:
        """A live request's later call: allocate for this step, or (``cache_only``) only
        append its outputs and cache what they complete."""
        request = self._requests.get(request_id)
        if request is None:
            raise NotFound(
                f"request {quoted(request_id)} is not live in this pool (a request's first call "
                "needs start; a freed or preempted request is admitted again with start)"
            )
        if self._recompute and request_id in self._recompute:
            return self._recompute_outcome(request)
        num_tokens_before = len(request.all_token_ids)
        if new_token_ids:
            if packed_token_ids is None:
                validate_token_ids(new_token_ids, "new_token_ids")
            # Packed tokens were validated when unpacked, but their count is bounded here
            # like any other: max_model_len holds on every path.
            if num_tokens_before + len(new_token_ids) > self.max_model_len:
                raise InvalidArgument(
                    "new_token_ids",
                    f"request {quoted(request_id)} would reach "
                    f"{num_tokens_before + len(new_token_ids)} tokens, past max_model_len="
                    f"{self.max_model_len}",
                )
            check_tokens_held(self, request_id, len(new_token_ids))
        computed_before = request.num_computed_tokens
        if num_rejected_tokens and not 0 <= num_rejected_tokens <= computed_before:
            raise InvalidArgument(
                "num_rejected_tokens",
                f"must be in [0, {computed_before}] (computed tokens), got {num_rejected_tokens}",
            )
        computed = computed_before - num_rejected_tokens
        if not 0 <= num_in_flight_tokens <= computed:
            raise InvalidArgument(
                "num_in_flight_tokens",
                f"must be in [0, {computed}] (computed tokens), got {num_in_flight_tokens}",
            )
        if computed + num_new_tokens > self.max_model_len:
            raise InvalidArgument(
                "num_new_tokens",
                f"{computed} computed + {num_new_tokens} new tokens exceed max_model_len="
                f"{self.max_model_len}",
            )
        unscheduled_before = num_unscheduled_tokens(request)
        unscheduled = max(0, num_tokens_before + len(new_token_ids) - computed - num_new_tokens)
        if unscheduled > unscheduled_before:
            check_unscheduled(self, request_id, unscheduled - unscheduled_before)
        if new_token_ids:
            try:
                request.append_token_ids(new_token_ids)
            except (TypeError, struct.error) as exc:
                request.truncate(num_tokens_before)
                raise InvalidArgument(
                    "new_token_ids", f"token ids must be integers ({exc})"
                ) from None
        null_counts = self._null_counts
        nulls_before = None if null_counts is None else null_counts(request_id)
        request.num_computed_tokens = computed
        if cache_only:
            self.manager.cache_blocks(
                request, min(computed - num_in_flight_tokens, len(request.all_token_ids))
            )
            block_ids: tuple[list[int], ...] | None = self._no_new_blocks()
        else:
            block_ids = self.manager.allocate_block_ids(
                request,
                num_new_tokens,
                num_lookahead_tokens=num_lookahead_tokens,
                num_in_flight_tokens=num_in_flight_tokens,
            )
        if block_ids is None:
            request.truncate(num_tokens_before)
            request.num_computed_tokens = computed_before
            nulls = self._zeros if null_counts is None else null_counts(request_id)
            return AllocateOutcome(
                False,
                self._no_new_blocks(),
                nulls,
                0,
                num_new_tokens,
                computed_before,
                released=nulls_before is not None and nulls != nulls_before,
            )
        request.num_computed_tokens = computed + num_new_tokens
        self.num_tokens_held += len(new_token_ids)
        self.num_tokens_unscheduled += unscheduled - unscheduled_before
        if self._admissions:
            # The engine had the admission's reply: a repeat of it is no retry any more.
            self._admissions.pop(request_id, None)
        return AllocateOutcome(
            True,
            block_ids,
            self._zeros if null_counts is None else null_counts(request_id),
            0,
            num_new_tokens,
            request.num_computed_tokens,
        )

    def would_cache(self, request_id: str, num_tokens: int) -> bool:
        """Whether caching the request's blocks up to ``num_tokens`` tokens would index a
        block none of its calls processed yet (lets an engine skip a call that would
        change nothing)."""
        request = self._requests.get(request_id)
        if request is None or not self.manager.enable_caching:
            return False
        limit = min(num_tokens, len(request.all_token_ids))
        return any(
            limit // manager.block_size > manager.num_cached_block.get(request_id, 0)
            for manager in self.manager.coordinator.managers
        )

    def _allocate_general(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_in_flight_tokens: int = 0,
    ) -> AllocateOutcome:
        return self.allocate(
            request_id, token_ids, num_new_tokens, num_in_flight_tokens=num_in_flight_tokens
        )

    def free(self, request_ids: Sequence[str], *, preempted: bool = False) -> int:
        """Release requests; their full blocks stay cached for reuse.

        An id among the last :attr:`recently_freed` freed ones (and not admitted again)
        counts as freed already: a free retried after its reply was lost succeeds, with
        0 blocks for that id, instead of failing with NOT_FOUND.

        Args:
            request_ids: live (or recently freed) requests, freed in this order (each
                table tail first).
            preempted: the engine preempted them (counted in ``num_preemptions``).

        Returns:
            Blocks whose last holder went (back in the free queue).

        Raises:
            NotFound: an id that is neither live nor recently freed; nothing is freed then.
            InvalidArgument: an id listed twice.
        """
        if isinstance(request_ids, str):
            raise InvalidArgument("request_ids", "must be a sequence of ids, not one string")
        ids = list(request_ids)
        requests = self._requests
        recent = self._freed
        live = []
        for request_id in ids:
            if request_id in requests:
                live.append(request_id)
            elif request_id not in recent:
                raise NotFound(f"request {quoted(request_id)} is not live in this pool")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("request_ids", "lists a request more than once")
        pool = self.manager.block_pool
        freed_before = pool.num_freed_blocks
        admissions = self._admissions
        capacity = self.recently_freed
        flagged = self._recompute
        for request_id in live:
            self.manager.free(request_id)
            request = requests.pop(request_id)
            self.num_tokens_held -= request.num_tokens
            self.num_tokens_unscheduled -= num_unscheduled_tokens(request)
            if admissions:
                admissions.pop(request_id, None)
            if flagged:
                flagged.discard(request_id)
            if capacity:
                recent[request_id] = None
                if len(recent) > capacity:
                    recent.popitem(last=False)
        if preempted:
            self._num_preemptions += len(live)
        return pool.num_freed_blocks - freed_before

    def lookup(self, token_ids: Sequence[int], hashing: HashingContext | None = None) -> int:
        """Tokens of this prompt an admission would serve from the cache right now.

        The same cap as admission applies (at least one token is computed), and nothing
        changes: no block is touched and the prefix-cache stats do not count lookups, so
        routers polling many pools do not skew the hit rate.

        Raises:
            InvalidArgument: more tokens than max_model_len (no admission could cache
                them), token ids out of range, or a bad hashing context (multimodal
                items must lie inside the prompt).
        """
        return self.lookup_blocks(token_ids, hashing)[0]

    def lookup_blocks(
        self, token_ids: Sequence[int], hashing: HashingContext | None = None
    ) -> tuple[int, tuple[list[int], ...]]:
        """:meth:`lookup` with the hit blocks per group (the table an admission starts with).

        An engine that mirrors reference counts needs the ids to know which hits would
        leave the free queue when touched. Side-effect free, like :meth:`lookup`.

        Raises:
            InvalidArgument: as :meth:`lookup`.
        """
        return self.probe_lookup(self.prepare_lookup(token_ids, hashing))

    def lookup_capped(
        self,
        token_ids: Sequence[int],
        hashing: HashingContext | None,
        max_cache_hit_tokens: int | None,
    ) -> tuple[int, tuple[list[int], ...]]:
        """:meth:`lookup_blocks` with an admission's ``max_cache_hit_tokens`` cap."""
        prepared = self.prepare_lookup(token_ids, hashing)
        if max_cache_hit_tokens is not None and max_cache_hit_tokens < prepared.max_hit_tokens:
            prepared = PreparedLookup(
                prepared.block_hashes, max_cache_hit_tokens, max_cache_hit_tokens > 0
            )
        return self.probe_lookup(prepared)

    def check_lookup_length(self, num_tokens: int, field: str = "token_ids") -> None:
        """Refuse a lookup longer than max_model_len before its tokens are even decoded.

        No admission can take such a prompt, so none of it can be cached; hashing it
        would only cost (a 15.7M-token lookup took seconds).

        Raises:
            InvalidArgument: naming ``field`` and the limit.
        """
        if num_tokens > self.max_model_len:
            raise InvalidArgument(
                field,
                f"{num_tokens} tokens exceed the pool's max_model_len={self.max_model_len}: "
                "no admission takes a prompt that long, so none of it can be cached",
            )

    def prepare_lookup(
        self, token_ids: Sequence[int], hashing: HashingContext | None = None
    ) -> PreparedLookup:
        """The expensive half of a lookup: validate the prompt and hash its blocks.

        A pure function of the tokens, the context and the pool's fixed hashing settings
        (algorithm, seed, block size): it reads no block, table or index, so the server
        runs it outside the pool's lock, in a thread for long prompts, while writers
        go on. :meth:`probe_lookup` then reads the index.

        Raises:
            InvalidArgument: as :meth:`lookup`.
        """
        num_tokens = len(token_ids)
        self.check_lookup_length(num_tokens)
        packed = pack_token_ids(token_ids, "token_ids")
        check_hashing_context(hashing, num_tokens)
        manager = self.manager
        hasher = manager.hasher
        extra = (
            BlockExtraKeys(hashing, hasher.block_size)
            if hasher is not None and hashing is not None and not hashing.is_empty
            else None
        )
        if hasher is None or num_tokens < 2 or not manager.enable_caching:
            return PreparedLookup([], 0, False)
        hashes = hasher.hash_blocks(
            token_ids, 0, num_tokens // hasher.block_size, None, extra, packed
        )
        return PreparedLookup(hashes, num_tokens - 1, True)

    def probe_lookup(self, prepared: PreparedLookup) -> tuple[int, tuple[list[int], ...]]:
        """The index half of a lookup: the hit of prepared hashes right now (cheap; run
        it between writers). Touches and counts nothing.

        Returns:
            The hit length in tokens and the hit blocks per group.
        """
        if not prepared.enabled:
            return 0, self._no_new_blocks()
        hits, num_hit_tokens = self.manager.coordinator.find_longest_cache_hit(
            prepared.block_hashes, prepared.max_hit_tokens
        )
        return num_hit_tokens, tuple(list(group) for group in hits)

    def block_table(self, request_id: str) -> BlockTableView:
        """A copy of the request's tables.

        Raises:
            NotFound: the request is not live.
        """
        request = self._requests.get(request_id)
        if request is None:
            raise NotFound(f"request {quoted(request_id)} is not live in this pool")
        tables = self.manager.coordinator.get_blocks(request_id)
        return BlockTableView(
            groups=tuple(list(t) for t in tables),
            num_computed_tokens=request.num_computed_tokens,
            num_tokens=request.num_tokens,
            needs_recompute=request_id in self._recompute,
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def request_state(self, request_id: str) -> RequestState | None:
        """A live request's state (read it, never change it: the pool owns it)."""
        return self._requests.get(request_id)

    @property
    def num_requests(self) -> int:
        """Live requests."""
        return len(self._requests)

    def needs_recompute(self, request_id: str) -> bool:
        """Whether a live request was flagged by :meth:`invalidate` (and not freed since)."""
        return request_id in self._recompute

    def request_ids(self) -> list[str]:
        """Live request ids, in admission order."""
        return list(self._requests)

    def requests_needing_recompute(self, prefix: str = "") -> list[str]:
        """Live ids flagged by :meth:`invalidate` that start with ``prefix``, sorted (a
        call that frees them all frees them in the same order when it is replayed)."""
        return sorted(rid for rid in self._recompute if rid.startswith(prefix))

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        """Per group, leading blocks shared by every live request (cascade attention).

        Raises:
            NotFound: the request is not live.
        """
        if request_id not in self._requests:
            raise NotFound(f"request {quoted(request_id)} is not live in this pool")
        return self.manager.get_num_common_prefix_blocks(request_id)

    # -- pool-wide -----------------------------------------------------------------------

    def usage(self) -> UsageSnapshot:
        pool = self.manager.block_pool
        stats = self.manager.prefix_cache_stats
        return UsageSnapshot(
            num_blocks=pool.num_blocks - 1,
            num_free_blocks=pool.get_num_free_blocks(),
            usage=pool.get_usage(),
            num_requests=len(self._requests),
            num_cached_blocks=pool.num_cached_blocks,
            queries=stats.queries,
            hits=stats.hits,
            preempted_queries=stats.preempted_queries,
            preempted_hits=stats.preempted_hits,
            requests=stats.requests,
            preempted_requests=stats.preempted_requests,
            num_evictions=pool.num_evictions,
            num_allocated_blocks=pool.num_allocated_blocks,
            num_freed_blocks=pool.num_freed_blocks,
            num_preemptions=self._num_preemptions,
            num_requests_needing_recompute=len(self._recompute),
            num_invalidations=self.num_invalidations,
        )

    def usage_free_blocks(self) -> int:
        """Free blocks (cached ones included), without building a usage snapshot."""
        return self.manager.block_pool.get_num_free_blocks()

    def free_queue_head(self, limit: int, offset: int = 0) -> list[int]:
        """``limit`` free block ids from position ``offset`` of the free queue, in the
        order allocations take them.

        An engine that replicates its pool reads the whole queue this way (page by page)
        when it connects, so its replica allocates the ids the server will. A page costs
        O(``limit``): it starts from the queue's front, its back, or where the previous
        page ended (:meth:`FreeBlockQueue.page`), and one that would first walk more than
        :data:`MAX_FREE_QUEUE_WALK` links of the cached region is refused.

        Raises:
            InvalidArgument: ``offset`` is that far from every such position (nothing
                is read).
        """
        queue = self.manager.block_pool.free_queue
        walk = queue.page_walk(offset, limit)
        if walk > MAX_FREE_QUEUE_WALK:
            raise InvalidArgument(
                "free_queue_head_offset",
                f"position {offset} lies {walk} ids into the free queue's cached region, "
                f"more than {MAX_FREE_QUEUE_WALK} from its front, its back and the end of "
                "the last page read: read the queue from offset 0 page after page, with "
                "no change to the pool in between",
            )
        return queue.page(offset, limit)

    def adopt_free_order(self, order: Sequence[int]) -> None:
        """Make the free queue ``order`` (front first): every usable block, each once.

        Only for an idle pool (no live request, no cached block), which is what a fresh
        replica of an idle server pool is: it then allocates exactly the ids the server's
        pool does.

        Raises:
            ValueError: the pool is not idle, or ``order`` is not a permutation of the
                usable block ids.
        """
        pool = self.manager.block_pool
        if self._requests or pool.num_index_entries():
            raise ValueError("the free order can only be set on an idle pool with no cache")
        if sorted(order) != list(range(1, pool.num_blocks)):
            raise ValueError("the free order must name every usable block id exactly once")
        pool.free_queue.load_order(order)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix index (e.g. after a weight update).

        Returns:
            False, with nothing changed, while any request holds blocks.
        """
        return self.manager.reset_prefix_cache()

    def invalidate(self) -> tuple[int, int]:
        """The pool's KV data is gone (a rank came back with fresh tensors, or an operator
        reset the cache by force): forget every cached hash and flag every live request.

        The prefix index is emptied at once (one ``AllBlocksCleared`` event), held blocks
        included, so nothing serves stale KV as a hit. Live requests keep their blocks
        (the engine's view of them stays right) but every later allocation of one answers
        ``recompute`` and changes nothing, until the engine frees it (as preempted) and
        admits it again with its tokens so far.

        Returns:
            The requests flagged and the blocks that lost their hash.
        """
        dropped = self.manager.block_pool.clear_prefix_index()
        self._recompute.update(self._requests)
        # A flagged request answers ``recompute`` to a repeated admission too.
        self._admissions.clear()
        self.num_invalidations += 1
        return len(self._requests), dropped

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the prefix index (e.g. their KV failed to load).

        Held blocks stay held; the null block (0) has no hash and is ignored.

        Raises:
            InvalidArgument: an id outside the pool; nothing is evicted then.
        """
        ids = list(block_ids)
        limit = self.manager.block_pool.num_blocks
        # As objects: compiled, a declared int/bytes would fail before the check.
        unchecked: Sequence[object] = ids
        for block_id in unchecked:
            if type(block_id) is not int or not 0 <= block_id < limit:
                raise InvalidArgument(
                    "block_ids", f"block id {block_id!r} is outside the pool [0, {limit})"
                )
        self.manager.evict_blocks(ids)

    def take_events(self) -> KVEventBatch | None:
        """Events since the last call as the next numbered batch; None if nothing happened."""
        return self.manager.take_events()

    def take_event_batches(self) -> list[KVEventBatch]:
        """Events since the last call as the next numbered batches, each small enough for
        any subscriber (:data:`~kvsvc.core.events.MAX_BATCH_WIRE_BYTES`); empty if nothing
        happened. What the server drains after every change."""
        return self.manager.take_event_batches()

    # -- state (persistence) -------------------------------------------------------------

    def config_state(self) -> dict[str, Any]:
        """What a saved state must have been made under to be loaded into this pool
        (:func:`~kvsvc.core.pool_state.pool_config_state`)."""
        return pool_config_state(self)

    def to_state(self) -> dict[str, Any]:
        """Everything that decides what this pool answers next, as plain values
        (:func:`~kvsvc.core.pool_state.pool_to_state`)."""
        return pool_to_state(self)

    def load_state(self, state: dict[str, Any]) -> None:
        """Become the pool :meth:`to_state` described, this pool being fresh and of the
        same config (:func:`~kvsvc.core.pool_state.load_pool_state`)."""
        load_pool_state(self, state)

    def set_limits(
        self,
        *,
        max_requests: int | None,
        recently_freed: int,
        max_tokens: int | None = None,
        max_unscheduled_tokens: int | None = None,
    ) -> None:
        """Apply new bounds to a running pool (a restart with another config): live
        requests above a lower ``max_requests`` or ``max_tokens`` stay; admissions wait
        below it.

        Raises:
            ValueError: a bound out of range.
        """
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_unscheduled_tokens is not None and max_unscheduled_tokens < 1:
            raise ValueError(f"max_unscheduled_tokens must be >= 1, got {max_unscheduled_tokens}")
        self.max_tokens = max_tokens
        self.max_unscheduled_tokens = max_unscheduled_tokens
        if recently_freed < 0:
            raise ValueError(f"recently_freed must be >= 0, got {recently_freed}")
        self.max_requests = max_requests
        self.recently_freed = recently_freed
        self._trim_freed()

    @classmethod
    def from_state(cls, config: KVCacheConfig, state: dict[str, Any], **kwargs: Any) -> PoolKVCache:
        """A pool built from ``config`` with the state's settings, then loaded with
        ``state`` (:func:`~kvsvc.core.pool_state.pool_from_state`)."""
        return pool_from_state(cls, config, state, **kwargs)
