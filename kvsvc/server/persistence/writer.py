"""The writer of one pool's state: group commit of the journal rows, background
checkpoints, and snapshots that replace the journal, all driven from the server's event
loop (:class:`PoolPersistence`).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsvc.errors import Unavailable, quoted
from kvsvc.server.persistence.durability import disk_full
from kvsvc.server.persistence.journal_store import PoolStore
from kvsvc.server.persistence.records import (
    JournalRecord,
    RankRecord,
    SnapshotCapture,
    reply_digest,
)
from kvsvc.server.persistence.schema import SYNCHRONOUS_MODES
from kvsvc.server.persistence.snapshot_file import write_snapshot

log = logging.getLogger("kvsvc.server")

# Replay work (units of ~3 us) after which a snapshot replaces the journal, and the
# multiple of it at which one is taken even before snapshot_min_interval_s has passed: a
# restart replays well under two seconds whatever the load (state_bench measures it).
DEFAULT_SNAPSHOT_EVERY = 200_000
SNAPSHOT_OVERDUE_FACTOR = 2
# What replaying one journal row costs, in those units (measured by state_bench at 1M
# blocks and 10,000 live requests, with a margin for slower machines): reading, checking
# and parsing the row, applying it, rebuilding and digesting its reply, and keeping it for
# retries, ~45-60 us for a single Allocate or Free; then ~2.5 us per operation and
# ~0.1-0.2 us per token (hashing a prompt, appending tokens). Counting a row as one unit,
# as this once did, under-counted single-call traffic 20-90 times: after 150 s of Allocate
# and Free calls no snapshot had been taken, and a restart replayed 81,000 rows in 22 s.
ROW_REPLAY_UNITS = 25
TOKENS_PER_REPLAY_UNIT = 16


def replay_units(operations: int, tokens: int) -> int:
    """The replay work of a journal row of ``operations`` operations carrying ``tokens``
    token ids (see :data:`ROW_REPLAY_UNITS`)."""
    return ROW_REPLAY_UNITS + operations + tokens // TOKENS_PER_REPLAY_UNIT


@dataclass(frozen=True, slots=True)
class StateSettings:
    """Where a pool's state is kept and how it is written (``state_dir`` and the
    ``state_*`` settings of the server's config)."""

    directory: Path
    synchronous: str = "normal"
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    snapshot_min_interval_s: float = 10.0
    checkpoint_interval_s: float = 1.0

    def create_store(
        self, identity: dict[str, Any], cache: Any, ranks: list[RankRecord]
    ) -> PoolStore:
        """A newly planned pool's store, starting with a snapshot of its empty ``cache``
        (run it in a thread).

        Raises:
            StateError: the pool already has a state file in the directory.
            OSError, sqlite3.Error: the files could not be written.
        """
        empty = SnapshotCapture(cache.to_state(), {"calls": []}, ranks, journal_seq=0)
        return PoolStore.create(
            self.directory,
            identity,
            empty.to_snapshot(identity, generation=1),
            synchronous=self.synchronous,
        )

    def writer(
        self,
        store: PoolStore,
        *,
        lock: asyncio.Lock,
        capture: Callable[[], SnapshotCapture],
        publish: Callable[[Any], None],
        journal_units: int | None = None,
    ) -> PoolPersistence:
        """The writer of ``store`` with these settings (see :class:`PoolPersistence`)."""
        return PoolPersistence(
            store,
            lock=lock,
            capture=capture,
            synchronous=self.synchronous,
            snapshot_every=self.snapshot_every,
            snapshot_min_interval_s=self.snapshot_min_interval_s,
            checkpoint_interval_s=self.checkpoint_interval_s,
            publish=publish,
            journal_units=journal_units,
        )


class PoolPersistence:
    """Group commit, checkpoints and snapshots of one pool's :class:`PoolStore`, driven
    from the server's event loop. The pool owns it (``Pool.persistence``; None while the
    pool is kept in memory only).

    A change is *recorded* (:meth:`record`, :meth:`update_rank`) under the pool's lock,
    in the order it was applied, and gets a ticket; the caller replies once
    :meth:`durable` says its ticket is committed. Everything recorded in one turn of the
    loop is committed in one transaction: on the loop itself in ``normal`` mode (a commit
    writes the WAL, ~30 us, no disk sync), in a thread in ``full`` mode (a disk sync per
    commit; calls recorded meanwhile wait for the next one).

    When a commit fails the store is *failed*: every waiting and later change is refused
    with UNAVAILABLE, so nothing is acknowledged that the disk does not hold (the pool's
    memory may be ahead of the disk then; restart the server).

    A snapshot replaces the journal once it holds ``snapshot_every`` units of replay work
    (:func:`replay_units`) and the last one is ``snapshot_min_interval_s`` old, or at once
    (one at a time) when it holds ``SNAPSHOT_OVERDUE_FACTOR`` times that: the interval
    spares a big pool's copy under moderate load, and never lets the replay grow past the
    bound under a heavy one. ``capture`` copies the pool's state, called under the pool's
    ``lock`` (between two calls); encoding and writing it run in a thread.
    """

    def __init__(
        self,
        store: PoolStore,
        *,
        lock: asyncio.Lock,
        capture: Callable[[], SnapshotCapture],
        synchronous: str = "normal",
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        snapshot_min_interval_s: float = 10.0,
        checkpoint_interval_s: float = 1.0,
        publish: Callable[[Any], None] | None = None,
        journal_units: int | None = None,
    ) -> None:
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"state_synchronous must be one of {SYNCHRONOUS_MODES}")
        self.store = store
        self._lock = lock
        self._capture = capture
        self.synchronous = synchronous
        self.snapshot_every = snapshot_every
        self.snapshot_min_interval_s = snapshot_min_interval_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.last_seq = store.last_seq
        # Replay work journaled since the snapshot (see record's ``units``): at a restart,
        # what the journal it replayed weighed (``journal_units``), or, unknown, one
        # snapshot's worth.
        if store.last_seq == store.snapshot_seq:
            self.work_since_snapshot = 0
        else:
            self.work_since_snapshot = (
                journal_units if journal_units is not None else snapshot_every
            )
        # Event batches of the recorded changes go to subscribers once committed.
        self._publish = publish
        self._batches: list[Any] = []
        self._records: list[JournalRecord] = []
        self._ranks: list[RankRecord] = []
        self._snapshot_install: tuple[int, int] | None = None
        self._ticket = 0  # last ticket handed out
        self._committed = 0  # last ticket committed
        self._waiters: list[tuple[int, Any]] = []
        self._flush_scheduled = False
        self._flushing = False
        self._dirty = False  # committed since the last checkpoint
        self.failed: str | None = None
        self.snapshotting = False
        self._last_snapshot = time.monotonic()
        self._checkpointer: Any = None
        self._snapshot_task: asyncio.Task[bool] | None = None
        # Figures (metrics, benchmarks).
        self.num_commits = 0
        self.num_records = 0
        self.num_snapshots = 0
        self.last_snapshot_seconds = 0.0

    # -- recording -------------------------------------------------------------------

    def check_writable(self) -> None:
        """Refuse a change before it is applied when nothing can be made durable.

        Raises:
            Unavailable: the store failed.
        """
        if self.failed is not None:
            raise Unavailable(self.failed)

    def record(
        self,
        kind: int,
        engine: str,
        payload: bytes,
        reply: bytes,
        batches: Sequence[Any] = (),
        units: int = ROW_REPLAY_UNITS,
    ) -> int:
        """Journal one applied call, right after the change and the events drain (under
        the pool's lock); returns its ticket. Schedules a snapshot when one is due.

        Args:
            kind: what ``payload`` is (a :class:`JournalKind`).
            engine: the engine namespace the call ran in.
            payload: the request as it came over the wire.
            reply: the serialized reply the caller gets (the row keeps its digest).
            batches: the events the call made, published once the commit is done.
            units: what replaying the row costs (:func:`replay_units`).
        """
        self.last_seq += 1
        self.work_since_snapshot += max(units, ROW_REPLAY_UNITS)
        self._records.append(
            JournalRecord(
                self.last_seq,
                kind,
                engine,
                payload,
                batches[-1].seq if batches else 0,
                batches[0].timestamp if batches else 0.0,
                reply_digest(reply),
            )
        )
        self._batches.extend(batches)
        ticket = self._next_ticket()
        if self.snapshot_due():
            self.schedule_snapshot()
        return ticket

    def update_rank(self, record: RankRecord) -> int:
        """Persist a rank's registration and tensor identity; returns its ticket."""
        self._ranks.append(record)
        return self._next_ticket()

    @property
    def records_since_snapshot(self) -> int:
        return self.last_seq - self.store.snapshot_seq

    def snapshot_due(self) -> bool:
        """Whether the journal holds enough replay work (and the last snapshot is old
        enough, unless the work is overdue) that a snapshot should replace it: keeps
        restarts short."""
        work = self.work_since_snapshot
        return (
            self.failed is None
            and not self.snapshotting
            and work >= self.snapshot_every
            and (
                work >= SNAPSHOT_OVERDUE_FACTOR * self.snapshot_every
                or time.monotonic() - self._last_snapshot >= self.snapshot_min_interval_s
            )
        )

    def _next_ticket(self) -> int:
        self._ticket += 1
        if not self._flush_scheduled and not self._flushing:
            self._flush_scheduled = True
            self._loop().call_soon(self._flush)
        return self._ticket

    @staticmethod
    def _loop() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # -- committing ------------------------------------------------------------------

    async def durable(self, ticket: int) -> None:
        """Return once everything up to ``ticket`` is committed.

        Raises:
            Unavailable: the commit failed (the change must not be acknowledged).
        """
        if ticket <= self._committed:
            return
        self.check_writable()
        if self.synchronous == "normal" and self._flush_scheduled:
            # The flush was scheduled when the change was recorded, so it runs before this
            # task resumes: one turn of the loop, not the two a future's wakeup takes.
            await asyncio.sleep(0)
            if ticket <= self._committed:
                return
            self.check_writable()
        waiter = self._loop().create_future()
        self._waiters.append((ticket, waiter))
        await waiter

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.failed is not None or self._flushing or self._ticket == self._committed:
            return
        records, ranks, install = self._records, self._ranks, self._snapshot_install
        batches, upto = self._batches, self._ticket
        self._records, self._ranks, self._snapshot_install, self._batches = [], [], None, []
        if self.synchronous == "full":
            self._flushing = True
            future = self._loop().run_in_executor(None, self.store.commit, records, ranks, install)
            future.add_done_callback(
                lambda f: self._after_commit(f.exception(), upto, len(records), batches)
            )
            return
        try:
            self.store.commit(records, ranks, install)
        except Exception as exc:  # sqlite3.Error, OSError: the disk said no
            self._after_commit(exc, upto, 0, [])
            return
        self._after_commit(None, upto, len(records), batches)

    def _after_commit(
        self, error: BaseException | None, upto: int, num_records: int, batches: list[Any]
    ) -> None:
        self._flushing = False
        if error is not None:
            self._fail(error)
            return
        if self._publish is not None:
            for batch in batches:  # in sequence order, as the commits are
                self._publish(batch)
        self._committed = upto
        self._dirty = True
        self.num_commits += 1
        self.num_records += num_records
        waiters, self._waiters = self._waiters, []
        for ticket, waiter in waiters:
            if ticket <= upto:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                self._waiters.append((ticket, waiter))
        if self._ticket > self._committed and not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop().call_soon(self._flush)

    def _fail(self, error: BaseException) -> None:
        full = disk_full(self.store.directory, error)
        cause = full or f"{type(error).__name__}: {error}"
        self.failed = (
            f"pool {quoted(self.store.pool)}: writing its state to {self.store.path} failed "
            f"({cause}); the server acknowledges no more changes of the pool: "
            f"{'free space on the disk' if full else 'fix the disk'} and restart it"
        )
        log.error("%s", self.failed)
        waiters, self._waiters = self._waiters, []
        for _, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(Unavailable(self.failed))

    # -- snapshots -------------------------------------------------------------------

    def _write_snapshot(self, capture: SnapshotCapture, generation: int) -> None:
        snapshot = capture.to_snapshot(self.store.identity, generation)
        write_snapshot(self.store.snapshot_path(generation), snapshot)

    async def install_snapshot(self, capture: SnapshotCapture) -> None:
        """Write a snapshot of ``capture`` (in a thread), point the journal at it, drop the
        rows it covers, then delete the previous snapshot once the pointer is on disk.

        Raises:
            Unavailable: the store failed meanwhile.
            OSError, sqlite3.Error: the snapshot could not be written (the old one stays).
        """
        loop = self._loop()
        started = time.perf_counter()
        self.snapshotting = True
        try:
            previous = self.store.snapshot_path()
            generation = self.store.snapshot_generation + 1
            await loop.run_in_executor(None, self._write_snapshot, capture, generation)
            self._snapshot_install = (generation, capture.journal_seq)
            self.work_since_snapshot = max(0, self.work_since_snapshot - capture.work)
            await self.durable(self._next_ticket())
            # The pointer must be on disk before the file it replaced goes.
            await loop.run_in_executor(None, self.store.checkpoint)
            previous.unlink(missing_ok=True)
            self.num_snapshots += 1
            self.last_snapshot_seconds = time.perf_counter() - started
        finally:
            self.snapshotting = False
            self._last_snapshot = time.monotonic()

    def schedule_snapshot(self) -> None:
        """Take a snapshot soon (a task: it waits for the pool's lock)."""
        if self._snapshot_task is None or self._snapshot_task.done():
            self._snapshot_task = self._loop().create_task(self.snapshot())

    async def snapshot(self) -> bool:
        """Replace the journal with a snapshot now (the next restart replays nothing).

        Returns:
            Whether one was written (False: busy, failed before, or it failed: logged, and
            the journal stays as it was).
        """
        if self.snapshotting or self.failed:
            return False
        self.snapshotting = True
        try:
            async with self._lock:
                capture = self._capture()
            await self.install_snapshot(capture)
        except Unavailable:
            return False
        except (OSError, sqlite3.Error, ValueError) as exc:
            log.error(
                "pool %r: writing a snapshot failed (the journal stays): %s", self.store.pool, exc
            )
            return False
        finally:
            self.snapshotting = False
        # Rows journaled while it was written may make the next one due already.
        self._loop().call_soon(self._snapshot_if_due)
        return True

    def _snapshot_if_due(self) -> None:
        if self.snapshot_due():
            self.schedule_snapshot()

    # -- checkpoints -----------------------------------------------------------------

    def start(self) -> None:
        """Start the background checkpoints (on the running loop)."""
        if self._checkpointer is None:
            self._checkpointer = self._loop().create_task(self._checkpoint_loop())

    async def _checkpoint_loop(self) -> None:
        loop = self._loop()
        while True:
            await asyncio.sleep(self.checkpoint_interval_s)
            if self._dirty and self.failed is None:
                self._dirty = False
                try:
                    await loop.run_in_executor(None, self.store.checkpoint)
                except Exception as exc:  # sqlite3.Error, OSError
                    self._fail(exc)

    async def close(self, *, final_snapshot: bool = True) -> None:
        """Commit what is pending, checkpoint, and close the files. With
        ``final_snapshot``, replace the journal by a snapshot first (a graceful stop: the
        next start, perhaps of a newer kvsvc, replays nothing)."""
        if self._snapshot_task is not None:
            await asyncio.gather(self._snapshot_task, return_exceptions=True)
        if final_snapshot and self.records_since_snapshot and not self.failed:
            await self.snapshot()
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            self._checkpointer = None
        if self.failed is None and self._ticket > self._committed:
            self._flush()
            await self.durable(self._ticket)
        if self.failed is None:
            try:
                await self._loop().run_in_executor(None, self.store.checkpoint)
            except Exception as exc:  # sqlite3.Error, OSError
                self._fail(exc)
        self.store.close()
