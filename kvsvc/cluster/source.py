"""What every index source follower shares: its options, and the thread that follows it.

The indexer follows kvsvc servers (:class:`kvsvc.cluster.indexer.Follower`) and vLLM ZMQ
streams (:class:`kvsvc.cluster.zmq_source.ZmqFollower`); both build on :class:`SourceThread`
here, and the indexer starts either kind. Kept apart from both so that neither imports the
other to share it: the indexer imports the ZMQ follower, never the reverse.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvsvc.cluster.layout import Keys
from kvsvc.cluster.lease import LeaseKeeper
from kvsvc.cluster.metrics import IndexerMetrics
from kvsvc.cluster.store import InvalidSource, LeaseLost, SourceStore, Tracking

_log = logging.getLogger("kvsvc.cluster")

# Defaults (flags of `kvsvc indexer`).
DEFAULT_LEASE_TTL_S = 10.0
DEFAULT_PURGE_AFTER_S = 300.0
DEFAULT_MAX_BATCH_EVENTS = 20_000
# Load reports for Route (kvsvc.cluster.load): how often each source's GetUsage is asked,
# and how long a report counts (past it, Route counts the engine's load as the mean).
DEFAULT_LOAD_INTERVAL_S = 0.5
DEFAULT_LOAD_TTL_S = 5.0


@dataclass(frozen=True, slots=True)
class IndexerOptions:
    """Attributes:
    lease_ttl_s: a source's lease lasts this long unrenewed (renewed every third, on
        a thread of its own: :class:`kvsvc.cluster.lease.LeaseKeeper`).
    purge_after_s: a source unreachable this long is purged from the index.
    max_batch_events: block events applied in one script call at most.
    client_options: how to reach the sources (token of the indexer role, TLS); a
        :class:`kvsvc_client.ClientOptions`, None for its defaults with
        ``role="indexer"``.
    keys: the key layout (prefix).
    load_interval_s: ask each source's load (GetUsage) this often for Route; 0: never.
    load_ttl_s: how long a load report counts.
    """

    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    purge_after_s: float = DEFAULT_PURGE_AFTER_S
    max_batch_events: int = DEFAULT_MAX_BATCH_EVENTS
    client_options: Any = None
    keys: Keys = field(default_factory=Keys)
    load_interval_s: float = DEFAULT_LOAD_INTERVAL_S
    load_ttl_s: float = DEFAULT_LOAD_TTL_S


def redis_error_type() -> type[Exception]:
    """redis-py's base error (redis, of the cluster extra, is imported when first needed)."""
    import redis

    return redis.exceptions.RedisError  # type: ignore[no-any-return]


class SourceThread:
    """What every source follower shares, whatever its stream (a kvsvc server's
    WatchEvents, a vLLM ZMQ stream): its name in the index, its store (lease, sequence
    guard, bits), its state in the metrics, and the thread that follows it.

    Subclasses give ``_run`` (the thread's loop, until ``_stop`` is set) and may give
    ``_interrupt`` (what wakes a loop blocked on its stream when it must stop). The loop
    takes the lease with :meth:`_take_lease`, reports a write refused for want of it with
    :meth:`_lease_refused`, and between two writes calls :meth:`_retake` when the keeper
    says the lease lapsed.
    """

    def __init__(
        self,
        name: str,
        client: Any,
        options: IndexerOptions,
        metrics: IndexerMetrics,
        owner: str,
        thread_name: str,
    ) -> None:
        self.name = name
        self.options = options
        self.metrics = metrics
        self.store = SourceStore(client, name, owner, options.keys, options.lease_ttl_s)
        self.lease = LeaseKeeper(self.store, name)
        self._lease_lost = False
        self.state_name = "standby"
        self.caught_up = threading.Event()  # set once the source is followed live
        self._stop = threading.Event()
        self._purge_on_stop = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._tracking: Tracking | None = None
        self._seq = 0

    def start(self) -> None:
        self.lease.start()
        self._thread.start()

    def stop(self, purge: bool = False, timeout: float = 10.0) -> None:
        """Stop following; with ``purge`` drop the source from the index (taken out of
        the sources) if this indexer holds its lease, else give the lease back."""
        self._purge_on_stop = purge
        self._stop.set()
        self._interrupt()
        self._thread.join(timeout)
        self.lease.close()

    def _interrupt(self) -> None:
        """Wake the loop if it is blocked on its stream (nothing by default)."""

    def _take_lease(self) -> bool:
        """Take the lease, or keep it (at the top of the loop); False: another indexer
        holds it (stand by)."""
        status = self.store.acquire()
        lost, self._lease_lost = self._lease_lost, False
        if status == "held":
            self.lease.drop()
            if lost:
                _log.warning("%s: another indexer holds the lease now; standing by", self.name)
            return False
        if lost and status == "new":
            _log.warning(
                "%s: its lease had lapsed (the indexer was paused, or starved past "
                "--lease-ttl); taken again, resuming from the index's sequence",
                self.name,
            )
        self.lease.hold()
        return True

    def _lease_refused(self) -> None:
        """A write was refused for want of the lease (it lapsed, and maybe another
        indexer took it): :meth:`_take_lease` decides at the top of the loop."""
        self.lease.drop()
        self.metrics.lease_lapses.inc()
        self._lease_lost = True

    def _retake(self) -> bool:
        """The keeper found the lease lapsed (checked between two writes): take it again,
        or raise LeaseLost when another indexer holds it now.

        Returns:
            True when it was taken afresh: the index may have moved meanwhile (another
            writer, or Redis restarted empty), and the caller checks it before writing.
        """
        status = self.store.acquire()
        if status == "held":
            raise LeaseLost(self.name)  # the loop's handler: _lease_refused
        self.lease.hold()
        if status == "new":
            self.metrics.lease_lapses.inc()
            _log.warning(
                "%s: its lease had lapsed (the indexer was paused, or starved past "
                "--lease-ttl); taken again",
                self.name,
            )
        return status == "new"

    def _set_state(self, name: str) -> None:
        self.state_name = self.metrics.move_source(self.state_name, name)

    def _quarantine(self, error: InvalidSource) -> None:
        """The source sent what the index cannot hold: drop its entries (so Score goes on
        for every other engine), say so once, and ignore it until stopped (a restarted
        indexer tries it again)."""
        self.metrics.quarantines.inc()
        self._set_state("quarantined")
        _log.warning(
            "%s: quarantined: it sent %s; its entries are dropped from the index and its "
            "stream ignored until the indexer restarts",
            self.name,
            error,
        )
        try:
            if self.store.acquire() != "held":
                self.store.purge()
                self.lease.drop()
                self.store.release()
        except (redis_error_type(), LeaseLost) as exc:
            _log.warning("%s: dropping its entries: %s", self.name, exc)
        self.lease.drop()
        self._tracking = None
        self._stop.wait()

    def _run(self) -> None:
        raise NotImplementedError
