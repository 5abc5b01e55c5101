"""What a pool's engine calls came to, counted as plain ints so the hot path pays one add
per outcome; :mod:`kvsvc.server.metrics` reads them at scrape time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineCounters:
    """Engine-call outcomes, plain ints so the hot path pays one add; metrics read them."""

    allocate_ok: int = 0
    allocate_no_space: int = 0
    free_requests: int = 0
    preempt_requests: int = 0
    freed_blocks: int = 0
    lookups: int = 0
    lookup_hit_tokens: int = 0
    steps: int = 0
    step_operations: int = 0
    # Called with each Step's operation count (the metrics module's histogram).
    step_size_observer: Callable[[int], None] | None = field(
        default=None, repr=False, compare=False
    )

    def count_allocate(self, outcome: Any) -> None:
        if outcome.ok:
            self.allocate_ok += 1
        else:
            self.allocate_no_space += 1

    def count_free(self, num_requests: int, num_freed_blocks: int, preempted: bool) -> None:
        if preempted:
            self.preempt_requests += num_requests
        else:
            self.free_requests += num_requests
        self.freed_blocks += num_freed_blocks

    def count_step(self, num_operations: int) -> None:
        self.steps += 1
        self.step_operations += num_operations
        if self.step_size_observer is not None:
            self.step_size_observer(num_operations)

    def count_lookup(self, num_cached_tokens: int) -> None:
        self.lookups += 1
        self.lookup_hit_tokens += num_cached_tokens
