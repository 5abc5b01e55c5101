"""Keeping a source's lease while its writer works.

A source's lease (``layout.LEASE``) names the one indexer that may write the source, for
``lease_ttl_s`` unless renewed, and every write script checks it. The writer's thread
used to renew it between two runs of batches, so whatever held that thread for longer
than the TTL let the lease lapse under a live writer: a ``SnapshotIndex`` download (up to
its 60 s deadline) and the install after it, or a run on a loaded machine or a slow
Redis Cluster. Its next write was then refused (``LeaseLost``) and thrown away, a heal
longer than the TTL started over and over, and a standby indexer could take the source
over meanwhile, only to lose it the same way.

:class:`LeaseKeeper` renews on a thread of its own, every third of the TTL, whatever the
writer is doing (a blocked socket read, a long script, the GIL shared with a busy
thread: a thread that waits on a timer gets its turn). It only extends a lease its
writer holds (``layout.RENEW``) and never takes one: a lease that lapsed all the same
(the whole process paused past the TTL, Redis restarted without it) is reported through
:attr:`LeaseKeeper.lapsed`, and the writer takes it again itself between two writes,
after which it re-reads what the index holds before writing on.
"""

from __future__ import annotations

import logging
import threading

from kvsvc.cluster.store import SourceStore

_log = logging.getLogger("kvsvc.cluster")


class LeaseKeeper:
    """Renews ``store``'s lease while its writer says it holds it (:meth:`hold`).

    Args:
        store: the source's store (its lease TTL sets the renewal interval).
        name: the source's name, for the thread and the log.
    """

    def __init__(self, store: SourceStore, name: str) -> None:
        self.store = store
        self.name = name
        self.interval_s = store.lease_ttl_ms / 3000
        self._cond = threading.Condition()
        self._holding = False
        self._closed = False
        self._lapsed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def hold(self) -> None:
        """The writer holds the lease (it just acquired it): renew it from now on."""
        with self._cond:
            self._lapsed.clear()
            self._holding = True
            self._cond.notify_all()

    def drop(self) -> None:
        """The writer no longer holds the lease (it stands by, released or lost it)."""
        with self._cond:
            self._holding = False
            self._cond.notify_all()

    @property
    def lapsed(self) -> bool:
        """A renewal found the lease gone or another's: the writer must take it again
        (or stand by) before it writes on. Cleared by :meth:`hold`."""
        return self._lapsed.is_set()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        import redis

        failing = False
        while True:
            with self._cond:
                while not (self._closed or self._holding):
                    self._cond.wait()
                # One interval from the hold (or the last renewal), unless closed or
                # dropped meanwhile; a hold during the wait only renews early.
                self._cond.wait(self.interval_s)
                if self._closed:
                    return
                if not self._holding:
                    continue
            try:
                kept = self.store.renew()
            except redis.exceptions.RedisError as exc:
                # The writer meets the same Redis and handles it; a renewal that keeps
                # failing lets the lease lapse, which the writer's scripts then report.
                if not failing:
                    _log.warning("%s: renewing the lease: %s; retrying", self.name, exc)
                failing = True
                continue
            failing = False
            if not kept:
                with self._cond:
                    if self._holding:
                        self._holding = False
                        self._lapsed.set()
