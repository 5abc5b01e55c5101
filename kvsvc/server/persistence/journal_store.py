"""One pool's journal database (``DIR/<pool>.db``, SQLite in WAL mode): its identity, its
ranks, the rows of the calls that changed it since its current snapshot, and the pointer to
that snapshot. Synchronous: :class:`~kvsvc.server.persistence.writer.PoolPersistence`
drives it from the event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvsvc.server.persistence.durability import AckedMarker, refused_start
from kvsvc.server.persistence.records import JournalRecord, RankRecord, Snapshot, StateError
from kvsvc.server.persistence.schema import (
    JOURNAL_FORMAT,
    check_file,
    configure_wal,
    connect,
    create_journal_schema,
    fsync_path,
    init_file,
    ranks_rows,
    read_meta,
    read_ranks,
    rollback,
)
from kvsvc.server.persistence.snapshot_file import read_snapshot, snapshot_name, write_snapshot
from kvsvc.server.persistence.wal import wal_damage, wal_path

_INSERT_ROW = "INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
# What an operator can do with a journal that lost commits it had acknowledged.
_WAYS_ON = (
    "The state cannot be served as it was acknowledged: move {pool}.db* out of the state "
    "directory, then start with --restore on the pool's newest snapshot (moved out too; "
    "the calls journaled after it are lost: a new event epoch, engines free and readmit "
    "their requests), or with no file to start the pool empty"
)


def _generation_of(name: str, pool: str) -> int | None:
    """N of ``<pool>.snapshot-N.db`` (None: another file)."""
    prefix, suffix = f"{pool}.snapshot-", ".db"
    middle = name[len(prefix) : -len(suffix)]
    if name.startswith(prefix) and name.endswith(suffix) and middle.isdigit():
        return int(middle)
    return None


class PoolStore:
    """The journal database of one pool (synchronous; :class:`PoolPersistence` drives it).

    Not thread-safe: one writer at a time (the event loop, or one flush thread), and
    :meth:`checkpoint` from one other thread (it has its own connection).
    """

    def __init__(self, directory: Path, pool: str, conn: sqlite3.Connection) -> None:
        self.directory = directory
        self.pool = pool
        self.path = directory / f"{pool}.db"
        self._conn = conn
        self._checkpoint_conn: sqlite3.Connection | None = None
        meta = read_meta(conn)
        try:
            self.identity: dict[str, Any] = json.loads(meta["identity"])
            self.snapshot_generation = int(meta["snapshot_generation"])
            self.snapshot_seq = int(meta["snapshot_seq"])
        except (KeyError, ValueError) as exc:
            raise StateError(f"{self.path} is damaged: meta {exc}") from None
        if self.identity.get("pool") != pool:
            raise StateError(
                f"{self.path} holds the state of pool {self.identity.get('pool')!r}, not "
                f"{pool!r} (a file copied under another name?)"
            )
        row = conn.execute("SELECT MAX(seq) FROM journal").fetchone()
        self.last_seq = max(self.snapshot_seq, row[0] or 0)
        self.acked = AckedMarker(self.path, str(self.identity.get("store_id", "")))

    @staticmethod
    def path_for(directory: Path, pool: str) -> Path:
        return directory / f"{pool}.db"

    @classmethod
    def open(cls, directory: Path, pool: str, *, synchronous: str = "normal") -> PoolStore | None:
        """The pool's store in ``directory``, or None when it has no state there.

        Raises:
            StateError: a state file that cannot be used.
        """
        path = cls.path_for(directory, pool)
        if not path.exists():
            return None
        conn = connect(path, create=False)
        try:
            check_file(conn, path, JOURNAL_FORMAT, migrate=True)
            configure_wal(conn, synchronous)
            return cls(directory, pool, conn)
        except StateError as exc:
            # While this connection is open the log is still there to be read.
            damage = wal_damage(path)
            conn.close()
            if damage is None:
                raise
            raise StateError(
                f"{path} is damaged: {damage}; it reads as an earlier state whose pages do "
                f"not fit those already written to the database ({exc}). "
                f"{_WAYS_ON.format(pool=pool)}"
            ) from None
        except BaseException:
            conn.close()
            raise

    @classmethod
    def create(
        cls,
        directory: Path,
        identity: dict[str, Any],
        snapshot: Snapshot,
        *,
        synchronous: str = "normal",
    ) -> PoolStore:
        """A new store for ``identity["pool"]`` that starts at ``snapshot`` (written first).

        Raises:
            StateError: the pool already has a state file in ``directory``.
            OSError, sqlite3.Error: the files could not be written.
        """
        pool = identity["pool"]
        path = cls.path_for(directory, pool)
        if path.exists():
            raise StateError(f"{path} exists already: the pool has a state (move it away first)")
        write_snapshot(directory / snapshot_name(pool, snapshot.generation), snapshot)
        staging = path.with_name(path.name + ".tmp")
        staging.unlink(missing_ok=True)
        conn = connect(staging, create=True)
        try:
            init_file(conn, JOURNAL_FORMAT, create_journal_schema)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [
                    ("identity", json.dumps(identity, sort_keys=True)),
                    ("snapshot_generation", snapshot.generation),
                    ("snapshot_seq", snapshot.journal_seq),
                ],
            )
            conn.executemany("INSERT INTO ranks VALUES (?, ?, ?)", ranks_rows(snapshot.ranks))
            conn.execute("COMMIT")
        finally:
            conn.close()
        fsync_path(staging)
        os.replace(staging, path)
        fsync_path(directory)
        store = cls.open(directory, pool, synchronous=synchronous)
        assert store is not None
        store._write_acked()  # a new lineage: a marker left by another one is replaced
        return store

    def close(self) -> None:
        for conn in (self._conn, self._checkpoint_conn):
            if conn is not None:
                conn.close()
        self._checkpoint_conn = None
        self.acked.close()

    def check_acknowledged(self) -> str | None:
        """At a restart, before anything is written: why this may be an earlier state
        than the one acknowledged (the journal ends before the last row acknowledged: the
        WAL was cut; or the acknowledged position is missing or garbage, so nothing
        shows the journal is whole), else None. Records the journal's end as acknowledged
        when it is not earlier (:meth:`renew_epoch` records it otherwise).

        Raises:
            StateError: the position cannot be recorded (the message says a full disk).
        """
        acknowledged, problem = self.acked.read_checked()
        if problem is not None:
            return f"{problem}: nothing shows that the journal holds every acknowledged change"
        assert acknowledged is not None
        if acknowledged > self.last_seq:
            cause = wal_damage(self.path) or "a power loss, or a damaged file"
            return (
                f"its journal ends at row {self.last_seq}, but row {acknowledged} was "
                f"acknowledged (its write-ahead log was cut: {cause})"
            )
        self._write_acked()
        return None

    def renew_epoch(self, epoch: str) -> None:
        """Give the state a new event epoch (an earlier state than the one acknowledged:
        its sequence numbers from here on were handed out already in the old epoch).

        Raises:
            StateError: it cannot be written (the message says a full disk).
        """
        identity = {**self.identity, "epoch": epoch}
        try:
            self._conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'identity'",
                (json.dumps(identity, sort_keys=True),),
            )
        except sqlite3.Error as exc:
            raise StateError(
                refused_start(self.directory, exc) or f"{self.path}: cannot write its epoch: {exc}"
            ) from None
        self.identity = identity
        self._write_acked()

    def _write_acked(self) -> None:
        try:
            self.acked.write(self.last_seq)
        except OSError as exc:
            raise StateError(
                refused_start(self.directory, exc) or f"{self.acked.path}: {exc.strerror}"
            ) from None

    # -- reading ---------------------------------------------------------------------

    def snapshot_path(self, generation: int | None = None) -> Path:
        return self.directory / snapshot_name(self.pool, generation or self.snapshot_generation)

    def load_snapshot(self) -> Snapshot:
        """The current snapshot, checked against this store.

        Raises:
            StateError: missing (saying why: the journal lost its latest commits, or the
                file was removed), damaged, or another store's.
        """
        if not self.snapshot_path().exists():
            raise StateError(self._missing_snapshot())
        snapshot = read_snapshot(self.snapshot_path())
        if snapshot.identity.get("store_id") != self.identity.get("store_id"):
            raise StateError(
                f"{self.snapshot_path()} belongs to another state of pool {self.pool!r} "
                "(store ids differ): refusing to mix them"
            )
        if (snapshot.generation, snapshot.journal_seq) != (
            self.snapshot_generation,
            self.snapshot_seq,
        ):
            raise StateError(
                f"{self.snapshot_path()} is generation {snapshot.generation} at journal "
                f"position {snapshot.journal_seq}; {self.path} expects "
                f"{self.snapshot_generation} at {self.snapshot_seq}"
            )
        return snapshot

    def _missing_snapshot(self) -> str:
        """Why the snapshot the journal points at is not there. A snapshot file is only
        deleted once a later one is pointed at, so a later one beside a journal that
        points at a deleted one means the journal lost the commits since (a damaged or
        cut write-ahead log), not that a file went missing."""
        generation = self.snapshot_generation
        later = sorted(
            (g, path.name)
            for path in self.directory.glob(f"{self.pool}.snapshot-*.db")
            if (g := _generation_of(path.name, self.pool)) is not None and g > generation
        )
        missing = f"{self.path} points at snapshot {self.snapshot_path().name}, which is not there"
        if not later:
            return (
                f"{missing}: the file was removed or moved (no later snapshot is there either); "
                "put it back, or move the pool's files away to start it empty"
            )
        cause = wal_damage(self.path) or (
            f"{wal_path(self.path).name} was cut or damaged (it ends before those commits)"
        )
        acknowledged = self.acked.read()
        lost = (
            f"; the journal ends at row {self.last_seq}, row {acknowledged} was acknowledged"
            if acknowledged is not None and acknowledged > self.last_seq
            else ""
        )
        return (
            f"{missing}: {later[-1][1]} replaced it later, so the journal lost its latest "
            f"commits: {cause}{lost}. {_WAYS_ON.format(pool=self.pool)}"
        )

    def ranks(self) -> list[RankRecord]:
        return read_ranks(self._conn, self.path)

    def journal(self, after: int) -> Iterator[JournalRecord]:
        """Journal rows after position ``after``, in order, each checked.

        Raises:
            StateError: a damaged row, or a gap in the positions.
        """
        expected = after + 1
        try:
            rows = self._conn.execute(
                "SELECT seq, kind, engine, payload, event_seq, event_ts, reply_digest, checksum "
                "FROM journal WHERE seq > ? ORDER BY seq",
                (after,),
            )
            for *fields_, checksum in rows:
                record = JournalRecord(*fields_)
                if not isinstance(record.payload, bytes) or not isinstance(record.engine, str):
                    raise StateError(f"{self.path}: journal row {record.seq} is damaged")
                if record.seq != expected:
                    raise StateError(
                        f"{self.path}: journal row {expected} is missing (next is {record.seq})"
                    )
                if record.checksum() != checksum:
                    raise StateError(f"{self.path}: journal row {record.seq} is damaged")
                expected += 1
                yield record
        except sqlite3.DatabaseError as exc:
            raise StateError(f"{self.path} is damaged ({exc})") from None

    def size_bytes(self) -> int:
        """Bytes of the pool's files (journal, its WAL, the current snapshot)."""
        total = 0
        for path in (
            self.path,
            self.path.with_name(self.path.name + "-wal"),
            self.path.with_name(self.path.name + "-shm"),
            self.snapshot_path(),
        ):
            with contextlib.suppress(OSError):
                total += path.stat().st_size
        return total

    # -- writing ---------------------------------------------------------------------

    def commit(
        self,
        records: list[JournalRecord],
        ranks: list[RankRecord],
        snapshot: tuple[int, int] | None = None,
    ) -> None:
        """One transaction: append ``records``, update ``ranks``, and (``snapshot`` =
        ``(generation, journal_seq)``) point at a new snapshot and drop the rows it covers.

        Raises:
            sqlite3.Error: the transaction failed (rolled back).
            OSError: the acknowledged position could not be recorded (the rows are in).
        """
        conn = self._conn
        rows = [
            (
                r.seq,
                r.kind,
                r.engine,
                r.payload,
                r.event_seq,
                r.event_ts,
                r.reply_digest,
                r.checksum(),
            )
            for r in records
        ]
        if len(rows) == 1 and not ranks and snapshot is None:
            # The common case (one Step): one statement is its own transaction.
            conn.execute(_INSERT_ROW, rows[0])
            self.acked.write(records[0].seq)
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            if rows:
                conn.executemany(_INSERT_ROW, rows)
            if ranks:
                conn.executemany("INSERT OR REPLACE INTO ranks VALUES (?, ?, ?)", ranks_rows(ranks))
            if snapshot is not None:
                generation, seq = snapshot
                conn.executemany(
                    "UPDATE meta SET value = ? WHERE key = ?",
                    [(generation, "snapshot_generation"), (seq, "snapshot_seq")],
                )
                conn.execute("DELETE FROM journal WHERE seq <= ?", (seq,))
            conn.execute("COMMIT")
        except BaseException:
            rollback(conn)
            raise
        if records:
            self.acked.write(records[-1].seq)
        if snapshot is not None:
            self.snapshot_generation, self.snapshot_seq = snapshot

    def checkpoint(self) -> None:
        """Sync the WAL to disk and copy it into the database (another connection: runs
        beside the writer). This is what bounds a power loss's reach in ``normal`` mode.

        Raises:
            sqlite3.Error: the checkpoint failed.
        """
        if self._checkpoint_conn is None:
            self._checkpoint_conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False
            )
        self._checkpoint_conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
