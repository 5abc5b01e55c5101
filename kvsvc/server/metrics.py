"""Prometheus metrics of the server, read from the pools at scrape time.

The core and the pools keep plain counters (the hot path pays an integer add); a custom
collector turns them into metric families when Prometheus scrapes. The per-call series
are plain numbers too (:class:`PlainHistogram`): each call's gRPC accounting (a count by
code and a latency histogram) and each Step's size cost a few adds, not prometheus_client's
locked value objects.

Naming follows Prometheus conventions: ``kvsvc_`` prefix, base units, ``_total`` on
counters, ``_info`` for metadata, and only bounded labels (pool, group, kind, rank,
code; the gRPC series use the go-grpc-prometheus names and labels). Every series that is
known to exist is exported from the start, with 0.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvsvc import __version__, native
from kvsvc.metrics_http import serve_metrics_http
from kvsvc.server.busy_poll import BusyPollMetrics, poll_stats
from kvsvc.server.config import split_host_port
from kvsvc.server.errors import CallObserver
from kvsvc.server.gc_pauses import gc_pauses
from kvsvc.server.handler_stages import HandlerStageMetrics, handler_stages
from kvsvc.server.pool import PoolState
from kvsvc.tls import ServerTlsSource

# Method -> (service, type) for the gRPC series.
_METHODS: dict[str, tuple[str, str]] = {
    **{
        m: ("kvsvc.v1.KVCacheService", "unary")
        for m in (
            "Allocate",
            "Free",
            "Step",
            "Lookup",
            "GetBlockTable",
            "GetUsage",
            "ResetPrefixCache",
        )
    },
    "WatchEvents": ("kvsvc.v1.KVCacheService", "server_stream"),
    "Register": ("kvsvc.v1.WorkerService", "unary"),
    "WatchPlan": ("kvsvc.v1.WorkerService", "server_stream"),
    "ReportAllocation": ("kvsvc.v1.WorkerService", "unary"),
    "Heartbeat": ("kvsvc.v1.WorkerService", "unary"),
    "ListPools": ("kvsvc.v1.AdminService", "unary"),
    "GetPlan": ("kvsvc.v1.AdminService", "unary"),
}

# Latency buckets from 50 us (a decode Step's server time) to 10 s.
LATENCY_BUCKETS = (
    0.00005,
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
    0.5,
    1.0,
    2.5,
    10.0,
)
STEP_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class PlainHistogram:
    """One histogram series as plain numbers: :meth:`observe` is a bisect (in C) and two
    adds, where prometheus_client's ``Histogram.observe`` took ~9k instructions (a lock and
    a value object per bucket and for the sum). Its owner exports it at scrape time as
    prometheus_client's own would be (cumulative ``le`` buckets, ``+Inf`` last, the sum;
    no ``_created`` sample).

    Observed only on the server's event-loop thread (every call's accounting runs there);
    a scrape, on the metrics thread, may read one observation's bucket before its sum.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(bound) for bound in bounds)
        # counts[i]: observations in (bounds[i-1], bounds[i]]; the last, above every bound.
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, as a bucket's ``le`` (value <= bound).
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """The cumulative buckets as the exposition names them."""
        total = 0
        out: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), total))
        return out


_OK = grpc.StatusCode.OK


class _MethodCalls:
    """One method's calls: its latency histogram and its counts by status code (OK apart:
    a StatusCode's hash is Python-level ``Enum.__hash__``, so the common outcome is
    counted by an identity test, not through a dict)."""

    __slots__ = ("failed", "latency", "ok")

    def __init__(self) -> None:
        self.latency = PlainHistogram(LATENCY_BUCKETS)
        self.ok = 0
        self.failed: dict[grpc.StatusCode, int] = {}


class _GrpcObserver(CallObserver, Collector):
    """The gRPC series (go-grpc-prometheus names and labels) of every call, framed ones
    included: ``grpc_server_handled_total`` by code and ``grpc_server_handling_seconds``,
    kept as plain numbers (an add and a :class:`PlainHistogram` observation a call, ~4k
    instructions against ~18k through prometheus_client's Counter and Histogram) and
    turned into families when scraped. Every method's series exist from the start (its OK
    count and its histogram, at 0)."""

    _LABELS = ("grpc_type", "grpc_service", "grpc_method")

    def __init__(self) -> None:
        self._calls = {method: _MethodCalls() for method in _METHODS}

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        calls = self._calls.get(method)
        if calls is None:
            return
        if code is _OK:
            calls.ok += 1
        else:
            calls.failed[code] = calls.failed.get(code, 0) + 1
        calls.latency.observe(seconds)

    def collect(self) -> Iterator[Any]:
        handled = CounterMetricFamily(
            "grpc_server_handled",
            "RPCs completed on the server, regardless of success or failure.",
            labels=(*self._LABELS, "grpc_code"),
        )
        seconds = HistogramMetricFamily(
            "grpc_server_handling_seconds",
            "Time from receiving an RPC to sending its last response.",
            labels=self._LABELS,
        )
        for method, calls in self._calls.items():
            service, kind = _METHODS[method]
            handled.add_metric([kind, service, method, _OK.name], calls.ok)
            for code, count in list(calls.failed.items()):
                handled.add_metric([kind, service, method, code.name], count)
            latency = calls.latency
            seconds.add_metric([kind, service, method], latency.buckets(), latency.sum)
        yield handled
        yield seconds


class _StepSizes(Collector):
    """``kvsvc_step_operations``: operations per Step call, a :class:`PlainHistogram` per
    pool (observed by the pool's :class:`~kvsvc.server.engine_stats.EngineCounters`)."""

    def __init__(self, pool_names: Iterable[str]) -> None:
        self.by_pool = {name: PlainHistogram(STEP_SIZE_BUCKETS) for name in pool_names}

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(
            "kvsvc_step_operations", "Operations per Step call.", labels=("pool",)
        )
        for name, histogram in self.by_pool.items():
            family.add_metric([name], histogram.buckets(), histogram.sum)
        yield family


class _PoolCollector(Collector):
    """Reads every pool's state and counters when scraped."""

    def __init__(self, pools: Any) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Any]:
        pools = list(self._pools.by_name.values())
        now = time.monotonic()

        build = InfoMetricFamily(
            "kvsvc_build", "kvsvc version, and its core's build: mypyc (compiled) or pure."
        )
        build.add_metric([], {"version": __version__, "core": native.BUILD})
        yield build

        info = InfoMetricFamily("kvsvc_pool", "Pool configuration.", labels=("pool",))
        state = GaugeMetricFamily(
            "kvsvc_pool_state", "1 for the state the pool is in.", labels=("pool", "state")
        )
        blocks = GaugeMetricFamily(
            "kvsvc_pool_blocks", "Usable KV cache blocks (null block excluded).", labels=("pool",)
        )
        free = GaugeMetricFamily(
            "kvsvc_pool_free_blocks", "Blocks not held by any request.", labels=("pool",)
        )
        used = GaugeMetricFamily(
            "kvsvc_pool_used_blocks", "Blocks held by requests.", labels=("pool",)
        )
        usage = GaugeMetricFamily(
            "kvsvc_kv_cache_usage_ratio",
            "Fraction of usable blocks held by requests (0-1).",
            labels=("pool",),
        )
        capacity = GaugeMetricFamily(
            "kvsvc_kv_cache_capacity_tokens", "Tokens the pool can hold.", labels=("pool",)
        )
        requests = GaugeMetricFamily(
            "kvsvc_pool_requests", "Requests holding blocks.", labels=("pool",)
        )
        cached = GaugeMetricFamily(
            "kvsvc_prefix_cache_blocks", "Blocks with a hash in the prefix index.", labels=("pool",)
        )
        planned = GaugeMetricFamily(
            "kvsvc_pool_planned_bytes", "KV cache bytes planned per rank.", labels=("pool", "rank")
        )
        queries = CounterMetricFamily(
            "kvsvc_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache.",
            labels=("pool", "kind"),
        )
        hits = CounterMetricFamily(
            "kvsvc_prefix_cache_hits_tokens",
            "Prompt tokens served from the prefix cache.",
            labels=("pool", "kind"),
        )
        evictions = CounterMetricFamily(
            "kvsvc_prefix_cache_evictions", "Cached blocks evicted for reuse.", labels=("pool",)
        )
        lookups = CounterMetricFamily("kvsvc_lookup_requests", "Lookup calls.", labels=("pool",))
        lookup_hits = CounterMetricFamily(
            "kvsvc_lookup_hit_tokens", "Cached tokens reported by Lookup.", labels=("pool",)
        )
        allocations = CounterMetricFamily(
            "kvsvc_allocations", "Allocate operations by outcome.", labels=("pool", "code")
        )
        allocated = CounterMetricFamily(
            "kvsvc_blocks_allocated", "Blocks handed to requests.", labels=("pool",)
        )
        freed = CounterMetricFamily(
            "kvsvc_blocks_freed", "Blocks whose last holder freed them.", labels=("pool",)
        )
        frees = CounterMetricFamily(
            "kvsvc_request_frees",
            "Requests freed, by kind (finished or preempted).",
            labels=("pool", "kind"),
        )
        published = CounterMetricFamily(
            "kvsvc_events_published", "KV events published, by kind.", labels=("pool", "kind")
        )
        dropped = CounterMetricFamily(
            "kvsvc_event_batches_dropped",
            "Event batches dropped from the replay buffer.",
            labels=("pool",),
        )
        subscribers = GaugeMetricFamily(
            "kvsvc_event_subscribers", "Open WatchEvents streams.", labels=("pool",)
        )
        subscribers_refused = CounterMetricFamily(
            "kvsvc_event_subscribers_refused",
            "WatchEvents calls refused because the pool had max_subscribers.",
            labels=("pool",),
        )
        subscribers_lagged = CounterMetricFamily(
            "kvsvc_event_subscribers_lagged",
            "Gap markers sent to subscribers that fell subscriber_max_lag_bytes behind "
            "(each skipped ahead).",
            labels=("pool",),
        )
        subscribers_cut = CounterMetricFamily(
            "kvsvc_event_subscribers_cut",
            "WatchEvents streams ended because a write did not complete within "
            "subscriber_write_timeout_s.",
            labels=("pool",),
        )
        buffer_bytes = GaugeMetricFamily(
            "kvsvc_event_buffer_bytes",
            "Bytes the replay buffer holds (bounded by event_buffer_bytes).",
            labels=("pool",),
        )
        registered = GaugeMetricFamily(
            "kvsvc_workers_registered", "Ranks registered.", labels=("pool",)
        )
        heartbeat_age = GaugeMetricFamily(
            "kvsvc_worker_heartbeat_age_seconds",
            "Seconds since a rank was last heard from.",
            labels=("pool", "rank"),
        )
        mem_total = GaugeMetricFamily(
            "kvsvc_worker_memory_total_bytes",
            "Device memory a rank reported.",
            labels=("pool", "rank"),
        )
        mem_free = GaugeMetricFamily(
            "kvsvc_worker_memory_free_bytes",
            "Free device memory a rank last reported.",
            labels=("pool", "rank"),
        )
        offered = GaugeMetricFamily(
            "kvsvc_worker_kv_cache_offered_bytes",
            "Bytes a rank offers the KV cache.",
            labels=("pool", "rank"),
        )
        reports = CounterMetricFamily(
            "kvsvc_worker_allocation_reports", "Allocation reports received.", labels=("pool",)
        )
        registrations = CounterMetricFamily(
            "kvsvc_worker_registrations", "Registrations accepted.", labels=("pool",)
        )
        plan_failures = CounterMetricFamily(
            "kvsvc_plan_failures", "Planning attempts that failed.", labels=("pool",)
        )

        for pool in pools:
            name = pool.name
            config = pool.config
            plan = pool.plan
            info.add_metric(
                [name],
                {
                    "model": pool.model_name,
                    "block_size": str(
                        plan.block_size if plan is not None else config.block_size or ""
                    ),
                    "hash_algo": config.hash_algo,
                    "prefix_caching": str(config.enable_prefix_caching).lower(),
                    "world_size": str(config.world_size),
                },
            )
            for s in PoolState:
                state.add_metric([name, s.name], 1.0 if pool.state == s else 0.0)
            cache = pool.cache
            snapshot = cache.usage() if cache is not None else None
            blocks.add_metric([name], snapshot.num_blocks if snapshot else 0)
            free.add_metric([name], snapshot.num_free_blocks if snapshot else 0)
            used.add_metric(
                [name], snapshot.num_blocks - snapshot.num_free_blocks if snapshot else 0
            )
            usage.add_metric([name], snapshot.usage if snapshot else 0.0)
            capacity.add_metric([name], plan.kv_cache_tokens if plan is not None else 0)
            requests.add_metric([name], snapshot.num_requests if snapshot else 0)
            cached.add_metric([name], snapshot.num_cached_blocks if snapshot else 0)
            if plan is not None:
                for rank in range(config.world_size):
                    planned.add_metric([name, str(rank)], pool.planned_bytes(rank))
            # The core counts new requests and resumptions apart (queries/hits are the
            # new ones only): each goes to its own kind, nothing to subtract.
            queries.add_metric([name, "new"], snapshot.queries if snapshot else 0)
            queries.add_metric([name, "preempted"], snapshot.preempted_queries if snapshot else 0)
            hits.add_metric([name, "new"], snapshot.hits if snapshot else 0)
            hits.add_metric([name, "preempted"], snapshot.preempted_hits if snapshot else 0)
            evictions.add_metric([name], snapshot.num_evictions if snapshot else 0)
            c = pool.counters
            lookups.add_metric([name], c.lookups)
            lookup_hits.add_metric([name], c.lookup_hit_tokens)
            allocations.add_metric([name, "ok"], c.allocate_ok)
            allocations.add_metric([name, "no_space"], c.allocate_no_space)
            allocated.add_metric([name], snapshot.num_allocated_blocks if snapshot else 0)
            freed.add_metric([name], snapshot.num_freed_blocks if snapshot else 0)
            frees.add_metric([name, "finished"], c.free_requests)
            frees.add_metric([name, "preempted"], c.preempt_requests)
            for kind, count in pool.events.num_events_by_type.items():
                published.add_metric([name, kind], count)
            dropped.add_metric([name], pool.events.num_dropped_batches)
            subscribers.add_metric([name], pool.events.num_subscribers)
            subscribers_refused.add_metric([name], pool.events.num_refused)
            subscribers_lagged.add_metric([name], pool.events.num_lagged)
            subscribers_cut.add_metric([name], pool.events.num_cut)
            buffer_bytes.add_metric([name], pool.events.held_bytes)
            registered.add_metric([name], len(pool.slots))
            reports.add_metric([name], pool.num_allocation_reports)
            registrations.add_metric([name], pool.num_registrations)
            plan_failures.add_metric([name], pool.num_plan_failures)
            for rank, slot in sorted(pool.slots.items()):
                labels = [name, str(rank)]
                heartbeat_age.add_metric(labels, max(0.0, now - slot.last_seen))
                mem_total.add_metric(labels, slot.registration.memory.total_bytes)
                mem_free.add_metric(
                    labels, slot.memory_free_bytes or slot.registration.memory.free_bytes
                )
                offered.add_metric(labels, slot.available_bytes)

        yield from (
            info,
            state,
            blocks,
            free,
            used,
            usage,
            capacity,
            requests,
            cached,
            planned,
            queries,
            hits,
            evictions,
            lookups,
            lookup_hits,
            allocations,
            allocated,
            freed,
            frees,
            published,
            dropped,
            subscribers,
            subscribers_refused,
            subscribers_lagged,
            subscribers_cut,
            buffer_bytes,
            registered,
            heartbeat_age,
            mem_total,
            mem_free,
            offered,
            reports,
            registrations,
            plan_failures,
        )


class ServerMetrics:
    """The server's metrics, on an explicit registry (tests get isolated ones)."""

    def __init__(self, pools: Any, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.call_observer = _GrpcObserver()
        self.registry.register(self.call_observer)
        self.step_operations = _StepSizes(pools.by_name)
        self.registry.register(self.step_operations)
        for pool in pools.by_name.values():
            pool.counters.step_size_observer = self.step_operations.by_pool[pool.name].observe
        self.registry.register(_PoolCollector(pools))
        self.registry.register(gc_pauses())
        self.registry.register(BusyPollMetrics(poll_stats()))
        self.registry.register(HandlerStageMetrics(handler_stages()))

    def serve_http(self, listen: str, tls: ServerTlsSource | None = None) -> tuple[Any, int]:
        """Serve ``/metrics`` on ``listen`` in a daemon thread; returns (server, port).

        With ``tls`` it is HTTPS with the gRPC listener's certificate, and a client CA
        there makes it require client certificates too: the metrics show pool names,
        sizes and traffic, which the gRPC listener's clients alone may see.
        """
        host, port = split_host_port(listen, "metrics_listen")
        server, _thread = serve_metrics_http(host, port, self.registry, tls)
        return server, server.server_port
