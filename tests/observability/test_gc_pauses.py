"""The server's garbage-collection pauses on /metrics: each collection of the process,
by generation, timed by the one gc.callbacks hook the process installs."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest

from kvsvc.server.gc_pauses import PAUSE_BUCKETS, gc_pauses
from tests.observability.promtext import parse, value


def _scrape() -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(gc_pauses())
    samples = parse(generate_latest(registry).decode())
    return {
        f"{generation}:{name}": value(
            samples, f"kvsvc_gc_pause_seconds_{name}", generation=str(generation)
        )
        for generation in range(3)
        for name in ("count", "sum")
    }


def test_each_collection_is_counted_and_timed_in_its_generation() -> None:
    # No automatic collection between the scrapes: only the three below are counted.
    gc.disable()
    try:
        before = _scrape()
        gc.collect(1)
        gc.collect(2)
        gc.collect(2)
        after = _scrape()
    finally:
        gc.enable()
    assert after["1:count"] - before["1:count"] == 1
    assert after["2:count"] - before["2:count"] == 2
    assert after["2:sum"] > before["2:sum"]
    assert gc.callbacks.count(gc_pauses()) == 1  # one hook, however many servers


def test_the_buckets_add_up_to_the_count() -> None:
    gc.collect()
    registry = CollectorRegistry()
    registry.register(gc_pauses())
    samples = parse(generate_latest(registry).decode())
    for generation in ("0", "1", "2"):
        counts = [
            value(samples, "kvsvc_gc_pause_seconds_bucket", generation=generation, le=repr(b))
            for b in PAUSE_BUCKETS
        ]
        total = value(samples, "kvsvc_gc_pause_seconds_bucket", generation=generation, le="+Inf")
        assert counts == sorted(counts) and counts[-1] <= total
        assert total == value(samples, "kvsvc_gc_pause_seconds_count", generation=generation)
    assert value(samples, "kvsvc_gc_pause_seconds_count", generation="2") >= 1
