"""A pool's bounds on the tokens its live requests hold: the checks and their errors.

``max_tokens`` bounds the tokens of the live requests together, ``max_unscheduled_tokens``
those not scheduled yet (see :class:`~kvsvc.core.pool.PoolKVCache`). Every path that adds
tokens (admission, a later ``allocate``, the running-batch loop) refuses past them with the
same words, before it changes anything.
"""

from __future__ import annotations

from kvsvc.core.pool_base import PoolKVCacheBase
from kvsvc.errors import ResourceExhausted, quoted


def check_tokens_held(cache: PoolKVCacheBase, request_id: str, num_new: int) -> None:
    """Refuse ``num_new`` more tokens past ``max_tokens`` (nothing changed yet)."""
    if cache.max_tokens is not None and cache.num_tokens_held + num_new > cache.max_tokens:
        raise too_many_tokens(cache, request_id, num_new)


def check_unscheduled(cache: PoolKVCacheBase, request_id: str, num_new: int) -> None:
    """Refuse ``num_new`` more unscheduled tokens past ``max_unscheduled_tokens``."""
    limit = cache.max_unscheduled_tokens
    if limit is not None and cache.num_tokens_unscheduled + num_new > limit:
        raise too_many_unscheduled(cache, request_id, num_new)


def too_many_tokens(cache: PoolKVCacheBase, request_id: str, num_new: int) -> ResourceExhausted:
    """The error for ``num_new`` more tokens past ``max_tokens``."""
    return ResourceExhausted(
        f"request {quoted(request_id)}: {num_new} more tokens would take the pool's live "
        f"requests to {cache.num_tokens_held + num_new} tokens, past its limit "
        f"(max_pool_tokens={cache.max_tokens}); free finished requests, or raise the "
        "pool's max_pool_tokens"
    )


def too_many_unscheduled(
    cache: PoolKVCacheBase, request_id: str, num_new: int
) -> ResourceExhausted:
    """The error for ``num_new`` more unscheduled tokens past ``max_unscheduled_tokens``."""
    return ResourceExhausted(
        f"request {quoted(request_id)}: {num_new} more tokens not scheduled would take "
        f"the pool's to {cache.num_tokens_unscheduled + num_new}, past its limit "
        f"(max_unscheduled_tokens={cache.max_unscheduled_tokens}); schedule what is "
        "admitted (num_new_tokens), free requests, or raise the pool's "
        "max_unscheduled_tokens"
    )
