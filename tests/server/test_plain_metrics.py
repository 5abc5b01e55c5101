"""The per-call series kept as plain numbers (kvsvc.server.metrics.PlainHistogram and the
gRPC observer) read exactly as prometheus_client's own Counter and Histogram would: the
same buckets, sums and counts, every method's series there from the start."""

from __future__ import annotations

import math
import random

import grpc
import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.metrics import (
    _METHODS,
    LATENCY_BUCKETS,
    STEP_SIZE_BUCKETS,
    PlainHistogram,
    _GrpcObserver,
    _StepSizes,
)


def _reference(bounds: tuple[float, ...], values: list[float]) -> tuple[list[float], float]:
    """prometheus_client's Histogram over ``values``: its cumulative bucket counts (in
    ``le`` order, +Inf last) and its sum."""
    registry = CollectorRegistry()
    histogram = Histogram("reference", "", buckets=bounds, registry=registry)
    for value in values:
        histogram.observe(value)
    buckets = [
        registry.get_sample_value("reference_bucket", {"le": le})
        for le, _ in PlainHistogram(bounds).buckets()
    ]
    assert None not in buckets, "the bucket bounds are named as prometheus_client names them"
    total = registry.get_sample_value("reference_sum")
    assert total is not None
    return [float(count) for count in buckets if count is not None], total


@pytest.mark.parametrize("bounds", [LATENCY_BUCKETS, STEP_SIZE_BUCKETS])
def test_a_plain_histogram_counts_as_prometheus_client_does(bounds: tuple[float, ...]) -> None:
    """Each bound itself (an observation equal to ``le`` is in that bucket), just above and
    below it, zero, past the last bound, and random values."""
    rng = random.Random(7)
    values: list[float] = [0.0, bounds[-1] * 10]
    for bound in bounds:
        values += [bound, math.nextafter(bound, 0), math.nextafter(bound, math.inf)]
    values += [rng.uniform(0, bounds[-1] * 1.5) for _ in range(500)]
    plain = PlainHistogram(bounds)
    for value in values:
        plain.observe(value)
    expected_buckets, expected_sum = _reference(bounds, values)
    assert [count for _, count in plain.buckets()] == expected_buckets
    assert plain.buckets()[-1] == ("+Inf", len(values))
    assert plain.sum == pytest.approx(expected_sum)


def test_every_bucket_counts_the_observation_equal_to_its_bound() -> None:
    plain = PlainHistogram((1, 2, 4))
    for value in (1, 2, 4):
        plain.observe(value)
    assert plain.buckets() == [("1.0", 1), ("2.0", 2), ("4.0", 3), ("+Inf", 3)]


def _samples(collector: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in collector.collect():  # type: ignore[attr-defined]
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _labels(method: str, **extra: str) -> tuple[tuple[str, str], ...]:
    service, kind = _METHODS[method]
    return tuple(
        sorted({"grpc_type": kind, "grpc_service": service, "grpc_method": method, **extra}.items())
    )


def test_the_grpc_observer_counts_each_call_by_method_and_code() -> None:
    observer = _GrpcObserver()
    fresh = _samples(observer)
    # Every method is there from the start: its OK count and an empty histogram.
    for method in _METHODS:
        assert fresh[("grpc_server_handled_total", _labels(method, grpc_code="OK"))] == 0
        assert fresh[("grpc_server_handling_seconds_count", _labels(method))] == 0
    observer.observe("Step", grpc.StatusCode.OK, 0.0003)
    observer.observe("Step", grpc.StatusCode.OK, 0.00005)
    observer.observe("Step", grpc.StatusCode.INVALID_ARGUMENT, 0.0)
    observer.observe("Allocate", grpc.StatusCode.RESOURCE_EXHAUSTED, 2.0)
    observer.observe("NotAMethod", grpc.StatusCode.OK, 1.0)  # not one of the series
    samples = _samples(observer)
    assert samples[("grpc_server_handled_total", _labels("Step", grpc_code="OK"))] == 2
    assert (
        samples[("grpc_server_handled_total", _labels("Step", grpc_code="INVALID_ARGUMENT"))] == 1
    )
    assert samples[("grpc_server_handled_total", _labels("Allocate", grpc_code="OK"))] == 0
    assert (
        samples[("grpc_server_handled_total", _labels("Allocate", grpc_code="RESOURCE_EXHAUSTED"))]
        == 1
    )
    assert samples[("grpc_server_handling_seconds_count", _labels("Step"))] == 3
    assert samples[("grpc_server_handling_seconds_sum", _labels("Step"))] == pytest.approx(0.00035)
    assert samples[("grpc_server_handling_seconds_bucket", _labels("Step", le="5e-05"))] == 2
    assert samples[("grpc_server_handling_seconds_bucket", _labels("Step", le="0.0005"))] == 3
    assert samples[("grpc_server_handling_seconds_bucket", _labels("Allocate", le="1.0"))] == 0
    assert samples[("grpc_server_handling_seconds_bucket", _labels("Allocate", le="2.5"))] == 1
    assert not any(labels and ("grpc_method", "NotAMethod") in labels for _, labels in samples)


def test_a_pools_step_sizes_are_its_counters_observations() -> None:
    sizes = _StepSizes(["a", "b"])
    counters = EngineCounters(step_size_observer=sizes.by_pool["a"].observe)
    for operations in (1, 2, 32, 9000):
        counters.count_step(operations)
    samples = _samples(sizes)
    pool_a, pool_b = (("pool", "a"),), (("pool", "b"),)
    assert samples[("kvsvc_step_operations_count", pool_a)] == 4
    assert samples[("kvsvc_step_operations_sum", pool_a)] == 9035
    assert samples[("kvsvc_step_operations_bucket", (("le", "1.0"), ("pool", "a")))] == 1
    assert samples[("kvsvc_step_operations_bucket", (("le", "2.0"), ("pool", "a")))] == 2
    assert samples[("kvsvc_step_operations_bucket", (("le", "32.0"), ("pool", "a")))] == 3
    assert samples[("kvsvc_step_operations_bucket", (("le", "8192.0"), ("pool", "a")))] == 3
    assert samples[("kvsvc_step_operations_bucket", (("le", "+Inf"), ("pool", "a")))] == 4
    assert samples[("kvsvc_step_operations_count", pool_b)] == 0
