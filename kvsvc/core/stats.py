"""Plain counters the core keeps; exporters (Prometheus, the wire) read them elsewhere."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups of admitted requests, in tokens (cumulative).

    Re-admissions after preemption are counted apart: their hits are mostly the request's
    own blocks and would flatter the hit rate.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens of new requests (0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class UsageSnapshot:
    """One pool's occupancy and cumulative counters at one moment.

    Attributes:
        num_blocks: usable blocks (the null block excluded).
        num_free_blocks: blocks in the free queue (cached-but-free ones included).
        usage: ``1 - num_free_blocks / num_blocks``.
        num_requests: live requests.
        num_cached_blocks: blocks in the prefix index (held or free).
        queries, hits, requests: prefix lookups of new requests (tokens, tokens, count).
        preempted_queries, preempted_hits, preempted_requests: the same for resumptions.
        num_evictions: cached blocks that lost their hash (reused, or ``evict_blocks``).
        num_allocated_blocks: blocks handed out of the free queue (prefix hits excluded).
        num_freed_blocks: blocks returned to the free queue.
        num_preemptions: requests freed as preempted.
        num_requests_needing_recompute: live requests whose KV data is gone (flagged by
            ``PoolKVCache.invalidate``, not freed since).
        num_invalidations: calls of ``PoolKVCache.invalidate`` over the pool's life.
    """

    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    num_cached_blocks: int
    queries: int
    hits: int
    preempted_queries: int
    preempted_hits: int
    requests: int
    preempted_requests: int
    num_evictions: int
    num_allocated_blocks: int
    num_freed_blocks: int
    num_preemptions: int = 0
    num_requests_needing_recompute: int = 0
    num_invalidations: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
