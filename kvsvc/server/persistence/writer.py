"""The writer of one pool's state: group commit of the journal rows, background
checkpoints, and snapshots that replace the journal, all driven from the server's event
loop (:class:`PoolPersistence`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvsvc.errors import Unavailable, quoted
from kvsvc.server.persistence.durability import disk_full
from kvsvc.server.persistence.journal_store import PoolStore
from kvsvc.server.persistence.records import JournalRecord, RankRecord, SnapshotCapture
from kvsvc.server.persistence.schema import SYNCHRONOUS_MODES
from kvsvc.server.persistence.snapshot_file import write_snapshot

log = logging.getLogger("kvsvc.server")

# Replay work (units of ~3 us: an operation, or 64 tokens) after which a snapshot replaces
# the journal: a restart replays about a second at most.
DEFAULT_SNAPSHOT_EVERY = 200_000


class PoolPersistence:
    """Group commit, checkpoints and snapshots of one pool's :class:`PoolStore`, driven
    from the server's event loop.

    A change is *recorded* (:meth:`record`, :meth:`update_rank`) under the pool's lock,
    in the order it was applied, and gets a ticket; the caller replies once
    :meth:`durable` says its ticket is committed. Everything recorded in one turn of the
    loop is committed in one transaction: on the loop itself in ``normal`` mode (a commit
    writes the WAL, ~30 us, no disk sync), in a thread in ``full`` mode (a disk sync per
    commit; calls recorded meanwhile wait for the next one).

    When a commit fails the store is *failed*: every waiting and later change is refused
    with UNAVAILABLE, so nothing is acknowledged that the disk does not hold (the pool's
    memory may be ahead of the disk then; restart the server).
    """

    def __init__(
        self,
        store: PoolStore,
        *,
        synchronous: str = "normal",
        snapshot_every: int = DEFAULT_SNAPSHOT_EVERY,
        snapshot_min_interval_s: float = 10.0,
        checkpoint_interval_s: float = 1.0,
        publish: Callable[[Any], None] | None = None,
    ) -> None:
        if synchronous not in SYNCHRONOUS_MODES:
            raise ValueError(f"state_synchronous must be one of {SYNCHRONOUS_MODES}")
        self.store = store
        self.synchronous = synchronous
        self.snapshot_every = snapshot_every
        self.snapshot_min_interval_s = snapshot_min_interval_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.last_seq = store.last_seq
        # Replay work journaled since the snapshot (see record's ``weight``): not kept on
        # disk, so a restart counts the journal it found as one snapshot's worth.
        self.work_since_snapshot = 0 if store.last_seq == store.snapshot_seq else snapshot_every
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
        event_seq: int,
        event_ts: float,
        digest: int,
        batches: Sequence[Any] = (),
        weight: int = 1,
    ) -> int:
        """Journal one applied call (``batches``: the events it made, published once the
        commit is done; ``weight``: what replaying it costs, one unit per operation and per
        64 tokens, ~3 us each); returns its ticket."""
        self.last_seq += 1
        self.work_since_snapshot += weight
        self._records.append(
            JournalRecord(self.last_seq, kind, engine, payload, event_seq, event_ts, digest)
        )
        self._batches.extend(batches)
        return self._next_ticket()

    def update_rank(self, record: RankRecord) -> int:
        """Persist a rank's registration and tensor identity; returns its ticket."""
        self._ranks.append(record)
        return self._next_ticket()

    @property
    def records_since_snapshot(self) -> int:
        return self.last_seq - self.store.snapshot_seq

    def snapshot_due(self) -> bool:
        """Whether the journal holds enough replay work (and the last snapshot is old
        enough) that a snapshot should replace it: keeps restarts short."""
        return (
            self.failed is None
            and not self.snapshotting
            and self.work_since_snapshot >= self.snapshot_every
            and time.monotonic() - self._last_snapshot >= self.snapshot_min_interval_s
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

    async def close(self) -> None:
        """Commit what is pending, checkpoint, and close the files."""
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
