"""The replay's two bounds, computed in process with kvsvc's own core.

- An infinite cache: every full block of every earlier prompt is still cached.
- One cache of the whole memory: the fleet's memory (engines x ``kv_tokens``) as one
  pool, LRU.

Both take the requests in arrival order, each admitted (with the pool's own hit rule:
full blocks, at least one token left to compute) and freed at once: no time, no load, no
routing, only what caching could give. The shared cache is what a perfect router could
come close to with no engine ever busier than another; the infinite one is what more
memory could add on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsvc.core import PoolKVCache, RequestStart
from kvsvc.replay.trace import TraceRequest
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec


@dataclass(frozen=True, slots=True)
class Bound:
    """A bound's hit ratio: prompt tokens served from cache over prompt tokens."""

    hit_ratio: float
    cached_tokens: int
    prompt_tokens: int


def _pool(num_blocks: int, block_size: int, max_model_len: int) -> PoolKVCache:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(
        num_blocks=num_blocks + 1,  # the null block
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    return PoolKVCache(
        config,
        max_model_len=max_model_len,
        hash_algo="xxh3_128",
        hash_seed="kvsvc-replay-bound",
        enable_events=False,
        recently_freed=0,
    )


def cache_bound(trace: Sequence[TraceRequest], block_size: int, num_blocks: int | None) -> Bound:
    """The hit ratio of one LRU pool of ``num_blocks`` blocks (None: room for every
    block the trace has: an infinite cache)."""
    longest = max(r.input_length for r in trace)
    if num_blocks is None:
        distinct = {b for r in trace for b in r.blocks}
        num_blocks = len(distinct) + 1
    num_blocks = max(num_blocks, -(-longest // block_size))
    pool = _pool(num_blocks, block_size, longest)
    cached = prompt = 0
    start = RequestStart()
    for r in trace:
        tokens = r.prompt_tokens(block_size)
        outcome = pool.allocate("r", tokens, len(tokens), start=start)
        assert outcome.ok, "one request alone always fits"
        cached += outcome.num_cached_tokens
        prompt += len(tokens)
        pool.free(["r"])
    return Bound(cached / prompt, cached, prompt)
