"""A request's admission (or resumption) into a PoolKVCache: its first ``allocate``.

The write path's first half, apart from the facade: validate the prompt and its start,
bound the pool's requests and tokens, hash the prompt, take the cached prefix, allocate the
step's slots, and remember the call so that a retry whose reply was lost is answered
again instead of refused. Part of the facade (``PoolKVCache.allocate`` calls
:func:`admit` when a call carries ``start``): it reads and writes the facade's request
bookkeeping as the facade's methods do.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import MutableSequence, Sequence

from kvsvc.core.hashing import check_hashing_context, pack_token_ids
from kvsvc.core.pool_base import PoolKVCacheBase
from kvsvc.core.pool_limits import check_tokens_held, check_unscheduled
from kvsvc.core.pool_types import AdmissionRecord, AllocateOutcome, RequestStart
from kvsvc.core.request import RequestState
from kvsvc.errors import AlreadyExists, InvalidArgument, ResourceExhausted, quoted


def admit(
    cache: PoolKVCacheBase,
    request_id: str,
    prompt: Sequence[int],
    budget: int,
    num_lookahead_tokens: int,
    start: RequestStart,
    packed: bytes | None = None,
) -> AllocateOutcome:
    """``cache.allocate(request_id, prompt, budget, num_lookahead_tokens, start)``: the
    call that carries ``start`` (``packed``: the prompt's packed form, already validated).

    Returns and raises what :meth:`~kvsvc.core.pool.PoolKVCache.allocate` documents for a
    first call; a refused admission leaves the request not live.
    """
    live = cache._requests.get(request_id)
    if live is not None:
        if cache._recompute and request_id in cache._recompute:
            return cache._recompute_outcome(live)
        return _repeat_admission(cache, live, prompt, budget, num_lookahead_tokens, start, packed)
    if not prompt:
        raise InvalidArgument("new_token_ids", "the first call must carry the prompt")
    if len(prompt) > cache.max_model_len:
        raise InvalidArgument(
            "new_token_ids",
            f"{len(prompt)} tokens exceed max_model_len={cache.max_model_len}",
        )
    # Token lists that come with their packed form were decoded for this call (the
    # wire path): take them over instead of copying.
    tokens: MutableSequence[int] = (
        prompt if packed is not None and isinstance(prompt, (list, array.array)) else list(prompt)
    )
    if packed is None:
        packed = pack_token_ids(prompt, "new_token_ids")
    drafts = start.num_draft_tokens
    if not 0 <= drafts <= budget:
        raise InvalidArgument(
            "start.num_draft_tokens", f"must be in [0, {budget}] (num_new_tokens), got {drafts}"
        )
    if start.num_encoder_tokens < 0:
        raise InvalidArgument(
            "start.num_encoder_tokens", f"must be >= 0, got {start.num_encoder_tokens}"
        )
    if not 0 <= start.num_prompt_tokens <= len(prompt):
        raise InvalidArgument(
            "start.num_prompt_tokens",
            f"must be in [0, {len(prompt)}] (the tokens sent), got {start.num_prompt_tokens}",
        )
    check_hashing_context(start.hashing, len(prompt), "start.hashing")
    if cache.max_requests is not None and len(cache._requests) >= cache.max_requests:
        raise ResourceExhausted(
            f"request {quoted(request_id)} not admitted: the pool holds {len(cache._requests)} "
            f"live requests, its limit (max_requests={cache.max_requests}); free finished "
            "requests or raise the pool's max_requests"
        )
    check_tokens_held(cache, request_id, len(prompt))
    manager = cache.manager
    try:
        request = manager.new_request(
            request_id,
            tokens,
            hashing=start.hashing,
            skip_reading_prefix_cache=start.skip_prefix_cache_read,
            resumed=start.resumed,
            num_encoder_tokens=start.num_encoder_tokens,
            packed_token_ids=packed,
        )
    except (TypeError, struct.error) as exc:
        raise InvalidArgument("new_token_ids", f"token ids must be integers ({exc})") from None
    if start.num_prompt_tokens:
        request.num_prompt_tokens = start.num_prompt_tokens
    hits, num_cached = manager.get_computed_blocks(
        request, record_stats=False, max_cache_hit_tokens=start.max_cache_hit_tokens
    )
    num_scheduled = min(budget - drafts, request.num_tokens - num_cached) + drafts
    unscheduled = max(0, request.num_tokens - num_cached - num_scheduled)
    if unscheduled:
        check_unscheduled(cache, request_id, unscheduled)
    block_ids = manager.allocate_block_ids(
        request,
        num_scheduled,
        num_cached,
        hits,
        num_lookahead_tokens,
        num_encoder_tokens=start.num_encoder_tokens,
    )
    if block_ids is None:
        return AllocateOutcome(
            False, cache._no_new_blocks(), cache._zeros, num_cached, num_scheduled, 0
        )
    if (
        manager.enable_caching
        and not start.skip_prefix_cache_read
        and start.max_cache_hit_tokens != 0
    ):
        manager.record_prefix_lookup(request, num_cached)
    request.num_computed_tokens = num_cached + num_scheduled
    cache._requests[request_id] = request
    cache.num_tokens_held += request.num_tokens
    cache.num_tokens_unscheduled += unscheduled
    cache._admissions[request_id] = AdmissionRecord(
        start, budget, num_lookahead_tokens, num_cached, num_scheduled
    )
    if cache._freed:
        cache._freed.pop(request_id, None)
    null_counts = cache._null_counts
    if num_cached or manager.coordinator.may_drop_blocks:
        # The table started empty: all of it (hits, null padding, new blocks) was
        # appended by this call, and the engine needs all of it.
        block_ids = tuple(list(t) for t in manager.coordinator.get_blocks(request_id))
    return AllocateOutcome(
        True,
        block_ids,
        cache._zeros if null_counts is None else null_counts(request_id),
        num_cached,
        num_scheduled,
        request.num_computed_tokens,
    )


def _repeat_admission(
    cache: PoolKVCacheBase,
    request: RequestState,
    prompt: Sequence[int],
    budget: int,
    num_lookahead_tokens: int,
    start: RequestStart,
    packed: bytes | None,
) -> AllocateOutcome:
    """Answer a first call for a live request: a retried admission, or AlreadyExists.

    An engine whose admission reply was lost (deadline, broken connection) cannot
    know whether it was applied; it sends it again. When the request is exactly as
    that admission left it (no successful call since) and the call is the same, the
    reply the engine missed is rebuilt from the state: nothing changes, nothing is
    counted twice. Anything else is a genuine duplicate id.
    """
    request_id = request.request_id
    record = cache._admissions.get(request_id)
    if (
        record is None
        or record.start != start
        or record.num_new_tokens != budget
        or record.num_lookahead_tokens != num_lookahead_tokens
        or not _same_tokens(request, prompt, packed)
    ):
        reason = (
            "it has been called since its admission"
            if record is None
            else "this call differs from its admission (prompt, start or counts)"
        )
        raise AlreadyExists(
            f"request {quoted(request_id)} is already live and {reason}; only a request's "
            "first call carries start (free it first to admit it anew)"
        )
    null_counts = cache._null_counts
    return AllocateOutcome(
        True,
        tuple(list(t) for t in cache.manager.coordinator.get_blocks(request_id)),
        cache._zeros if null_counts is None else null_counts(request_id),
        record.num_cached_tokens,
        record.num_scheduled_tokens,
        request.num_computed_tokens,
    )


def _same_tokens(request: RequestState, prompt: Sequence[int], packed: bytes | None) -> bool:
    """Whether ``prompt`` is the request's token sequence (compared as packed bytes, as
    a list and an ``array('I')`` of the same ids do not compare equal)."""
    tokens = request.all_token_ids
    if len(prompt) != len(tokens):
        return False
    if packed is None:
        try:
            packed = pack_token_ids(prompt, "new_token_ids")
        except InvalidArgument:
            return False
    if isinstance(tokens, array.array) and sys.byteorder == "little":
        return tokens.tobytes() == packed
    return pack_token_ids(tokens, "new_token_ids") == packed
