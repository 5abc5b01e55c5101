"""The indexer's Prometheus metrics (its own registry, served on its own ``/metrics``).

Labels stay bounded: ``source`` takes the configured sources' names (an operator's list,
not request data), ``kind`` / ``reason`` / ``state`` a few fixed values.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SNAPSHOT_REASONS = ("new", "gap", "epoch", "resync", "upgrade")
PURGE_REASONS = ("gone", "removed", "epoch")
STATES = ("writing", "standby", "down", "quarantined")


class IndexerMetrics:
    """Every series the indexer exports; those that exist are there from the start, at 0."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "kvsvc_indexer_events_total",
            "Block events applied to the index (one per block hash; cleared: one per clear)",
            ["kind"],
            registry=r,
        )
        for kind in ("stored", "removed", "cleared"):
            self.events.labels(kind)
        self.batches = Counter(
            "kvsvc_indexer_batches_total", "Event batches applied to the index", registry=r
        )
        self.lag = Gauge(
            "kvsvc_indexer_lag_seconds",
            "Seconds from a source's last applied batch being drained on its server to its "
            "bits being written to Redis",
            ["source"],
            registry=r,
        )
        self.sequence = Gauge(
            "kvsvc_indexer_sequence",
            "The last event sequence of a source applied to the index",
            ["source"],
            registry=r,
        )
        self.snapshots = Counter(
            "kvsvc_indexer_snapshots_total",
            "Sources healed from a SnapshotIndex (new: first indexed; gap: events lost; "
            "epoch: the server restarted without its state; resync: after a Redis error; "
            "upgrade: indexed by an indexer that did not track sliding windows)",
            ["reason"],
            registry=r,
        )
        for reason in SNAPSHOT_REASONS:
            self.snapshots.labels(reason)
        self.purges = Counter(
            "kvsvc_indexer_purges_total",
            "Sources dropped from the index (gone: unreachable past --purge-after; removed: "
            "taken out of the sources; epoch: restarted empty and not ready yet)",
            ["reason"],
            registry=r,
        )
        for reason in PURGE_REASONS:
            self.purges.labels(reason)
        self.quarantines = Counter(
            "kvsvc_indexer_quarantines_total",
            "Sources quarantined: they sent an event or tracking the index cannot hold "
            "(a block size of 0, negative or past 2^20, a group past 255, an oversized "
            "hash); their entries were dropped and their stream is ignored",
            registry=r,
        )
        self.lease_lapses = Counter(
            "kvsvc_indexer_lease_lapses_total",
            "Leases of sources this indexer was writing that lapsed under it (the process "
            "was paused or starved past --lease-ttl, or Redis lost them): each was taken "
            "again, or by another indexer",
            registry=r,
        )
        self.redis_errors = Counter(
            "kvsvc_indexer_redis_errors_total",
            "Redis commands that failed (connection lost, timeout, error reply)",
            registry=r,
        )
        self.source_errors = Counter(
            "kvsvc_indexer_source_errors_total",
            "Event streams or snapshots of a source that failed (it is retried)",
            registry=r,
        )
        self.inconsistent = Counter(
            "kvsvc_indexer_inconsistent_removals_total",
            "Removals of hashes the index did not hold for that source (0 unless events "
            "were lost without a gap marker)",
            registry=r,
        )
        self.sources = Gauge(
            "kvsvc_indexer_sources",
            "Sources by state (writing: this indexer holds the lease; standby: another "
            "does; down: unreachable; quarantined: it sent what the index cannot hold, "
            "dropped from the index until the indexer restarts)",
            ["state"],
            registry=r,
        )
        for state in STATES:
            self.sources.labels(state)
        self.load_reports = Counter(
            "kvsvc_indexer_load_reports_total",
            "Engine load reports (GetUsage) written for Route, by outcome (ok; error: the "
            "source's GetUsage failed, its last report ages out)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ok", "error"):
            self.load_reports.labels(outcome)
        self.apply_seconds = Histogram(
            "kvsvc_indexer_apply_seconds",
            "Time to apply one run of batches to Redis (script and bits)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )

    def move_source(self, old: str, new: str) -> str:
        """A source's state changes from ``old`` to ``new`` (``kvsvc_indexer_sources``);
        returns ``new``."""
        if new != old:
            self.sources.labels(old).dec()
            self.sources.labels(new).inc()
        return new
