"""The garbage collector's pauses, for ``/metrics``.

A collection stops the server's one event loop for as long as it walks the objects it
examines: every engine call waiting meanwhile waits that long. Such pauses were the tail
of the server's calls (a young collection walking the replay buffer's events took 2-9 ms,
the calls it interrupted 5-20x their p50; see :mod:`kvsvc.server.events`), and only a
histogram of them tells an operator whether a slow call was one. Exported per generation:
``kvsvc_gc_pause_seconds`` (a histogram) and ``kvsvc_gc_collected_objects_total``.

The pauses are timed by a ``gc.callbacks`` hook that only adds to plain lists: a
collection can start inside any allocation, a metric's own locked update included, so the
hook takes no lock; the collector reads the lists when Prometheus scrapes. One hook per
process, shared by every server in it.
"""

from __future__ import annotations

import gc
import time
from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

PAUSE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
_GENERATIONS = 3


class GcPauses(Collector):
    """Times each collection (``gc.callbacks``) and exports the pauses per generation."""

    def __init__(self) -> None:
        # Per generation: counts per bucket (the last one past every bound), seconds.
        self.counts = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(_GENERATIONS)]
        self.seconds = [0.0] * _GENERATIONS
        self.collected = [0] * _GENERATIONS
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        # A collection holds the GIL from its start to its stop: the two never interleave.
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.counts[generation][bisect_left(PAUSE_BUCKETS, pause)] += 1
        self.seconds[generation] += pause
        self.collected[generation] += info["collected"]

    def collect(self) -> Iterator[Any]:
        pauses = HistogramMetricFamily(
            "kvsvc_gc_pause_seconds",
            "Garbage collections of the server process and how long each stopped it.",
            labels=("generation",),
        )
        collected = CounterMetricFamily(
            "kvsvc_gc_collected_objects",
            "Unreachable objects the server's garbage collections freed.",
            labels=("generation",),
        )
        for generation in range(_GENERATIONS):
            cumulative = list(accumulate(self.counts[generation]))
            bounded = zip(PAUSE_BUCKETS, cumulative[:-1], strict=True)
            buckets = [(repr(bound), count) for bound, count in bounded]
            buckets.append(("+Inf", cumulative[-1]))
            pauses.add_metric([str(generation)], buckets, self.seconds[generation])
            collected.add_metric([str(generation)], self.collected[generation])
        yield pauses
        yield collected


_installed: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """This process's pause recorder, its hook installed on first use."""
    global _installed
    if _installed is None:
        _installed = GcPauses()
        gc.callbacks.append(_installed)
    return _installed
