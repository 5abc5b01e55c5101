"""The indexer: follows every source's WatchEvents into the cluster index in Redis.

One :class:`Follower` per source (``HOST:PORT/POOL``), each with two threads: a reader
that iterates the source's event stream (the typed client, :class:`kvsvc_client.
KVCacheClient`) into a bounded queue, and a writer that takes what has arrived (up to
``max_batch_events`` block events) and applies it with one script call and one pipeline
of bits (:class:`kvsvc.cluster.store.SourceStore`). A follower's life::

    standby ──lease──▶ flush pending bits ──▶ state in Redis? ──no──▶ snapshot ─┐
       ▲                                          │yes                          │
       │                                          ▼                             │
       └──lease lost──  follow WatchEvents from seq + 1 (epoch) ◀───────────────┘
                         │ gap marker / hole / other epoch ──▶ snapshot, follow again
                         │ Redis error ──▶ back off, then snapshot (Redis may have lost data)
                         │ source unreachable ──▶ retry; past purge_after: purge it

While it follows a source, the lease holder also asks its server's ``GetUsage`` every
``load_interval_s`` and writes the engine's load for Route (:mod:`kvsvc.cluster.load`).

Several indexers may follow the same sources: each source's lease (in Redis) names the
one that writes it, the others stand by and take over within ``lease_ttl_s`` of its
holder going away, resuming from the sequence stored in Redis. Restarting an indexer
resumes the same way (no snapshot unless the server no longer holds the batches).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvsvc.cluster.layout import SLIDING_WINDOW_KINDS
from kvsvc.cluster.load import LoadPublisher
from kvsvc.cluster.metrics import IndexerMetrics
from kvsvc.cluster.source import IndexerOptions, SourceThread, redis_error_type
from kvsvc.cluster.store import (
    InvalidSource,
    LeaseLost,
    SourceMoved,
    Tracking,
    parse_source,
    source_name,
)

_log = logging.getLogger("kvsvc.cluster")

# Batches a reader may hold before its writer takes them (bounds memory while Redis is
# slow: the server then holds them back, or cuts the stream with a gap marker).
READER_QUEUE_BATCHES = 1024
SNAPSHOT_TIMEOUT_S = 60.0
RETRY_BACKOFF_S = (0.1, 0.2, 0.5, 1.0, 2.0)


class _NeedSnapshot(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _SourceDown(Exception):
    pass


def _events_to_ops(batch: Any, tracked: frozenset[int]) -> tuple[list[bytes], int, int, int]:
    """A batch's events as script ops (tracked groups only), with its counts of stored,
    removed and cleared events."""
    from kvsvc_client import AllBlocksCleared, BlockRemoved, BlockStored

    ops: list[bytes] = []
    stored = removed = cleared = 0
    for event in batch.events:
        if isinstance(event, BlockStored):
            stored += len(event.block_hashes)
            if event.group_index in tracked:
                tag = b"S" + bytes([event.group_index])
                ops.extend(tag + h for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            removed += len(event.block_hashes)
            if event.group_index in tracked:
                tag = b"R" + bytes([event.group_index])
                ops.extend(tag + h for h in event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cleared += 1
            ops.append(b"C")
    return ops, stored, removed, cleared


class Follower(SourceThread):
    """Keeps one source's part of the index (see the module's docstring)."""

    def __init__(
        self,
        source: str,
        client: Any,
        options: IndexerOptions,
        metrics: IndexerMetrics,
        owner: str,
    ) -> None:
        self.target, self.pool = parse_source(source)
        name = source_name(self.target, self.pool)
        super().__init__(name, client, options, metrics, owner, f"index-{name}")
        self._kv: Any = None
        self._down_since: float | None = None
        self._purged = False
        self._resync = False
        self._untracked_said: tuple[int, ...] = ()
        self._epoch = ""
        self._load = LoadPublisher(client, options.keys, options.load_ttl_s)
        self._load_failing = False

    def _interrupt(self) -> None:
        kv = self._kv  # its WatchEvents stream ends when the client closes
        if kv is not None:
            kv.close()

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        self.metrics.sources.labels(self.state_name).inc()
        attempt = 0
        redis_error = redis_error_type()
        from kvsvc_client import KVCacheError

        while not self._stop.is_set():
            try:
                if not self._take_lease():
                    self._set_state("standby")
                    self._stop.wait(self.options.lease_ttl_s / 3)
                    continue
                self._set_state("writing")
                self._session()
                attempt = 0
            except LeaseLost:
                self._lease_refused()
                self._set_state("standby")
            except InvalidSource as exc:
                self._quarantine(exc)
            except redis_error as exc:
                self.metrics.redis_errors.inc()
                _log.warning("%s: Redis: %s; retrying, then resyncing", self.name, exc)
                self._resync = True
                self._stop.wait(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
                attempt += 1
            except (_SourceDown, KVCacheError) as exc:
                self.metrics.source_errors.inc()
                try:
                    self._source_down(str(exc))
                except (redis_error, LeaseLost) as inner:
                    _log.warning("%s: while it is unreachable: %s", self.name, inner)
                self._stop.wait(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
                attempt += 1
            except Exception:
                # A bug must not end the source's indexing in silence: say it, start over
                # from a snapshot.
                _log.exception("%s: unexpected error; resyncing", self.name)
                self.metrics.source_errors.inc()
                self._resync = True
                self._stop.wait(RETRY_BACKOFF_S[-1])
        self._finish()
        self.metrics.sources.labels(self.state_name).dec()

    def _finish(self) -> None:
        try:
            if self._purge_on_stop and self.store.acquire() != "held":
                cleared = self.store.purge()
                self.metrics.purges.labels("removed").inc()
                _log.info("%s: removed from the sources: purged (%d blocks)", self.name, cleared)
            self.lease.drop()
            self.store.release()
        except (redis_error_type(), LeaseLost) as exc:
            _log.warning("%s: stopping: %s", self.name, exc)

    def _source_down(self, why: str) -> None:
        self._set_state("down")
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            _log.warning("%s: unreachable (%s); retrying", self.name, why)
        if (
            not self._purged
            and now - self._down_since >= self.options.purge_after_s
            and self.store.acquire() != "held"
        ):
            cleared = self.store.purge()
            self.metrics.purges.labels("gone").inc()
            self._purged = True
            _log.warning(
                "%s: gone for %.0f s: purged from the index (%d blocks)",
                self.name,
                now - self._down_since,
                cleared,
            )

    def _reached(self) -> None:
        """The source answered: it is up again."""
        if self._down_since is not None:
            _log.info("%s: reachable again", self.name)
        self._down_since = None
        self._purged = False

    def _session(self) -> None:
        """Follow the source while this indexer holds the lease (returns when stopped)."""
        self.store.flush_pending()
        state = self.store.state()
        if state.epoch is None or state.tracking is None:
            self._heal("new")
        elif self._resync:
            self._heal("resync")
        elif state.tracking.legacy:
            # Written before the index tracked sliding windows: only a snapshot says the
            # source's windows (its groups' classes).
            self._heal("upgrade")
        else:
            self._tracking, self._seq, self._epoch = state.tracking, state.seq, state.epoch
            self.store.ensure_id()
            self._register()
        self._resync = False
        while not self._stop.is_set():
            try:
                self._follow()
                return
            except _NeedSnapshot as need:
                self._heal(need.reason)

    def _register(self) -> None:
        """Make sure the registry lists the source (a purge interrupted before its end
        may have dropped it)."""
        import json

        assert self._tracking is not None
        info = {"id": self.store.ensure_id(), **self._tracking.to_meta()}
        self.store.client.hset(self.store.keys.sources, self.name, json.dumps(info, sort_keys=True))

    # -- snapshots -----------------------------------------------------------------------

    def _heal(self, reason: str) -> None:
        """Replace the source's index by its server's SnapshotIndex."""
        import grpc

        from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc

        client_options = self._client_options()
        try:
            with client_options.channel(self.target) as channel:
                stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
                request = kvcache_pb2.SnapshotIndexRequest(pool=self.pool)
                messages = stub.SnapshotIndex(
                    request, timeout=SNAPSHOT_TIMEOUT_S, metadata=client_options.metadata()
                )
                header = None
                counts: dict[bytes, int] = {}
                tracked: frozenset[int] = frozenset()
                for message in messages:
                    if header is None:
                        header = message
                        tracking = Tracking.from_groups(
                            (
                                (g.group_index, g.group_kind, g.block_size, g.sliding_window)
                                for g in message.groups
                            ),
                            message.hash_block_size,
                            message.hash_algo,
                            message.hash_seed_fingerprint,
                            message.medium or "GPU",
                        )
                        tracked = tracking.tracked_groups
                        self._say_untracked(tracking, message.groups)
                    if message.group_index in tracked:
                        prefix = bytes([message.group_index])
                        for h, c in zip(message.block_hashes, message.block_counts, strict=True):
                            counts[prefix + h] = c
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if reason == "epoch" and code in (
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.UNAVAILABLE,
            ):
                # Restarted without its state and not serving yet: what it held is gone.
                cleared = self.store.purge()
                self.metrics.purges.labels("epoch").inc()
                _log.info("%s: new epoch, not ready: purged (%d blocks)", self.name, cleared)
            raise _SourceDown(f"SnapshotIndex: {code.name}: {exc.details()}") from None  # type: ignore[attr-defined]
        assert header is not None, "a SnapshotIndex stream has at least its header"
        self._reached()
        flips = self.store.install(header.epoch, header.sequence, tracking, counts)
        self.metrics.snapshots.labels(reason).inc()
        self._tracking, self._seq, self._epoch = tracking, header.sequence, header.epoch
        self.metrics.sequence.labels(self.name).set(self._seq)
        _log.info(
            "%s: snapshot (%s) at %s/%d: %d hashes, %d bits changed",
            self.name,
            reason,
            header.epoch,
            header.sequence,
            len(counts),
            flips,
        )

    def _say_untracked(self, tracking: Tracking, groups: Any) -> None:
        """Log, once per source (and again if it changes), the groups the index cannot
        follow: the source's scores are then upper bounds of its Lookup."""
        if tracking.untracked == self._untracked_said:
            return
        self._untracked_said = tracking.untracked
        if not tracking.untracked:
            return
        kinds = {g.group_index: g.group_kind for g in groups}
        parts = []
        for index in tracking.untracked:
            kind = kinds.get(index, "unknown")
            if kind in SLIDING_WINDOW_KINDS:
                kind += " without its window: the server predates IndexGroup.sliding_window"
            parts.append(f"{index} ({kind})")
        described = ", ".join(parts)
        _log.warning(
            "%s: groups %s are not tracked (kinds the index cannot follow): its scores are "
            "upper bounds of its Lookup",
            self.name,
            described,
        )

    def _client_options(self) -> Any:
        from kvsvc_client import ClientOptions

        return self.options.client_options or ClientOptions(role="indexer")

    # -- following -----------------------------------------------------------------------

    def _follow(self) -> None:
        """Stream from the stored sequence and apply until stopped or told to heal."""
        from kvsvc_client import KVCacheClient

        self.caught_up.clear()
        batches: queue.Queue[Any] = queue.Queue(READER_QUEUE_BATCHES)
        kv = KVCacheClient(self.target, self.pool, options=self._client_options())
        self._kv = kv
        reader = threading.Thread(
            target=self._read, args=(kv, batches), name=f"watch-{self.name}", daemon=True
        )
        reader.start()
        # The keeper renews the lease meanwhile; this loop only looks, between two runs,
        # whether it lapsed all the same, and asks the source's load every load_interval_s.
        tick = self.options.lease_ttl_s / 3
        load_every = self.options.load_interval_s
        next_load = time.monotonic()  # the first report at once
        try:
            while not self._stop.is_set():
                if self.lease.lapsed:
                    self._check_retaken()
                wait = tick
                if load_every > 0:
                    now = time.monotonic()
                    if now >= next_load:
                        self._report_load(kv)
                        next_load = now + load_every
                    wait = min(wait, next_load - now)
                try:
                    first = batches.get(timeout=max(0.001, wait))
                except queue.Empty:
                    continue
                run = [first]
                size = len(first.events) if not isinstance(first, BaseException) else 0
                while size < self.options.max_batch_events:
                    try:
                        item = batches.get_nowait()
                    except queue.Empty:
                        break
                    run.append(item)
                    if isinstance(item, BaseException):
                        break
                    size += len(item.events)
                self._apply(run)
        finally:
            self._kv = None
            kv.close()
            reader.join(5)

    def _report_load(self, kv: Any) -> None:
        """Ask the source's GetUsage and write its load for Route. A failed GetUsage is
        counted and skipped (its last report ages out past its TTL; the event stream says
        whether the source is down); a Redis error goes up like any other."""
        from kvsvc_client import KVCacheError

        try:
            usage = kv.usage(timeout=max(1.0, self.options.load_interval_s))
        except KVCacheError as exc:
            self.metrics.load_reports.labels("error").inc()
            if not self._load_failing:
                _log.warning("%s: GetUsage for its load: %s", self.name, exc)
            self._load_failing = True
            return
        self._load_failing = False
        used = usage.num_blocks - usage.num_free_blocks
        self._load.publish(self.store.ensure_id(), usage.num_requests, used, usage.num_blocks)
        self.metrics.load_reports.labels("ok").inc()

    def _check_retaken(self) -> None:
        """The lease lapsed: take it again (LeaseLost if another indexer has it). One
        taken afresh (the indexer was paused past the TTL, or Redis restarted and lost it)
        is checked against what Redis holds now: a source Redis lost, or that another
        writer moved meanwhile, is rebuilt, even while its server sends nothing."""
        if self._retake():
            self.store.flush_pending()  # what a writer in between decided, before ours
            state = self.store.state()
            if state.epoch != self._epoch or state.seq != self._seq:
                raise _NeedSnapshot("resync")

    def _read(self, kv: Any, out: queue.Queue[Any]) -> None:
        """The reader thread: the stream's messages, then the error that ended it."""
        try:
            stream = kv.watch_events(
                self._seq + 1, reconnect=False, epoch=self._epoch, caught_up=True
            )
            for batch in stream:
                out.put(batch)
            out.put(_SourceDown("the event stream ended"))
        except BaseException as exc:  # handed to the writer, which decides
            out.put(exc)

    def _apply(self, run: list[Any]) -> None:
        assert self._tracking is not None
        tracked = self._tracking.tracked_groups
        ops: list[bytes] = []
        first = last = 0
        stored = removed = cleared = 0
        timestamp = 0.0
        pending_error: BaseException | None = None
        for item in run:
            if isinstance(item, BaseException):
                pending_error = item
                break
            self._reached()
            if item.sequence == 0:
                if item.gap:
                    pending_error = _NeedSnapshot("epoch" if item.epoch != self._epoch else "gap")
                    break
                if item.caught_up:
                    self.caught_up.set()
                continue
            if item.epoch != self._epoch:
                pending_error = _NeedSnapshot("epoch")
                break
            position = last if first else self._seq
            if item.sequence <= position:
                continue  # applied already (a replay from before our position)
            if item.sequence != position + 1:
                pending_error = _NeedSnapshot("gap")
                break
            if not first:
                first = item.sequence
            last = item.sequence
            timestamp = item.timestamp
            batch_ops, s, r, c = _events_to_ops(item, tracked)
            ops.extend(batch_ops)
            stored, removed, cleared = stored + s, removed + r, cleared + c
        if first:
            started = time.perf_counter()
            result = self.store.apply(self._epoch, first, last, self._tracking, ops)
            self.metrics.apply_seconds.observe(time.perf_counter() - started)
            if result.missing:
                self.metrics.inconsistent.inc(result.missing)
            self._seq = last
            self.metrics.batches.inc(last - first + 1)
            self.metrics.events.labels("stored").inc(stored)
            self.metrics.events.labels("removed").inc(removed)
            self.metrics.events.labels("cleared").inc(cleared)
            self.metrics.sequence.labels(self.name).set(last)
            self.metrics.lag.labels(self.name).set(max(0.0, time.time() - timestamp))
        if pending_error is not None:
            if isinstance(pending_error, SourceMoved):
                raise _NeedSnapshot("gap")
            raise pending_error


def read_sources_file(path: str) -> list[str]:
    """Sources in ``path``: one ``HOST:PORT/POOL`` per line; blank and ``#`` lines skip.

    Raises:
        ValueError: the file cannot be read, or a line is not a source (naming the line).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--sources-file {path}: {exc.strerror}") from None
    sources = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            parse_source(line)
        except ValueError as exc:
            raise ValueError(f"--sources-file {path}, line {number}: {exc}") from None
        sources.append(line)
    return sources


class Indexer:
    """Followers for a set of sources that may change while it runs.

    Args:
        client: a Redis or RedisCluster client (shared by every follower).
        options: see :class:`IndexerOptions`.
        metrics: where to count (a fresh registry when None).
    """

    def __init__(
        self, client: Any, options: IndexerOptions, metrics: IndexerMetrics | None = None
    ) -> None:
        self.client = client
        self.options = options
        self.metrics = metrics or IndexerMetrics()
        self.owner = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.followers: dict[str, Follower] = {}
        self.zmq_followers: dict[str, Any] = {}
        self._lock = threading.Lock()

    def set_sources(self, sources: Iterable[str]) -> None:
        """Follow exactly ``sources``: new ones start, removed ones stop and are purged.

        Raises:
            ValueError: a source that is not ``HOST:PORT/POOL``.
        """
        wanted: dict[str, str] = {}
        for source in sources:
            target, pool = parse_source(source)
            wanted[source_name(target, pool)] = source
        with self._lock:
            for name in [n for n in self.followers if n not in wanted]:
                self.followers.pop(name).stop(purge=True)
            for name, source in wanted.items():
                if name not in self.followers:
                    follower = Follower(source, self.client, self.options, self.metrics, self.owner)
                    self.followers[name] = follower
                    follower.start()

    def add_zmq_sources(self, sources: Iterable[str], hash_algo: str) -> None:
        """Follow vLLM-format ZMQ event streams too (see :mod:`kvsvc.cluster.zmq_source`).

        Raises:
            ValueError: a source that is not ``ENDPOINT[,replay=ENDPOINT]``.
            ImportError: pyzmq or msgspec is missing (the ``vllm`` extra).
        """
        from kvsvc.cluster.zmq_source import ZmqFollower, parse_zmq_source

        parsed = [(source, parse_zmq_source(source)) for source in sources]
        import kvsvc.integrations.vllm.events  # noqa: F401  (says what is missing)

        with self._lock:
            for source, (endpoint, _) in parsed:
                if endpoint not in self.zmq_followers:
                    follower = ZmqFollower(
                        source, self.client, self.options, self.metrics, self.owner, hash_algo
                    )
                    self.zmq_followers[endpoint] = follower
                    follower.start()

    def wait_caught_up(self, timeout: float) -> bool:
        """Whether every follower holding its lease got live within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        for follower in list(self.followers.values()):
            if follower.state_name == "standby":
                continue
            if not follower.caught_up.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def stop(self) -> None:
        """Stop every follower and give their leases back (a standby takes over at once)."""
        with self._lock:
            followers, self.followers = list(self.followers.values()), {}
            zmq_followers, self.zmq_followers = list(self.zmq_followers.values()), {}
        for zmq_follower in zmq_followers:
            zmq_follower.stop()
        for follower in followers:
            follower._stop.set()
            if follower._kv is not None:
                follower._kv.close()
        for follower in followers:
            follower.stop()


def watch_sources_file(
    path: str,
    apply: Callable[[list[str]], None],
    stop: threading.Event,
    interval: float = 1.0,
    extra: Iterable[str] = (),
) -> None:
    """Re-read ``path`` every ``interval`` seconds and ``apply`` its sources (plus
    ``extra``) when its content changed; a file that became unreadable or bad keeps the
    last good list (and says so once)."""
    last: list[str] | None = None
    complained = ""
    while not stop.wait(interval):
        try:
            sources = [*extra, *read_sources_file(path)]
        except ValueError as exc:
            if str(exc) != complained:
                _log.warning("%s (keeping the previous sources)", exc)
                complained = str(exc)
            continue
        complained = ""
        if sources != last:
            apply(sources)
            last = sources
