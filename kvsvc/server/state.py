"""Pool state on disk: a journal of the calls that changed a pool, and snapshots of it.

Layout of a state directory (``kvsvc serve --state-dir DIR``, ``state_dir`` in the config)::

    DIR/<pool>.db                   the pool's journal database (SQLite, WAL mode)
    DIR/<pool>.db-wal, -shm         SQLite's write-ahead log and its index
    DIR/<pool>.snapshot-<N>.db      the pool's current snapshot (SQLite), generation N

Every file is created with mode 0600 (the hash seed of an ``xxh3_128`` pool is a secret)
and the directory with 0700.

The journal database holds the pool's identity (what the state was made for: the pool's
planning settings, each rank's registration, the hash algorithm and seed, the event
epoch), the ranks' tensor identities, and one row per call that changed the pool, in the
order they were applied: the request as it came over the wire (so replay runs the very
code that served it), the engine whose namespace it ran in, the number and time of the
event batch it produced and a digest of its reply. A snapshot database holds the whole
core state at one journal position (:meth:`kvsvc.core.PoolKVCache.to_state`, encoded by
:mod:`kvsvc.core.state`), with a checksum, plus the server's own per-pool state (the
replies of recent calls, kept so a retried call answers what the lost reply said).

Durability: a change is committed to the journal before its reply leaves the server.
Calls that arrive together share one transaction (group commit). With the default
``state_synchronous = "normal"`` a commit writes the WAL without waiting for the disk, so a
killed or crashed process loses nothing it acknowledged; a power loss or kernel crash can
lose the acknowledged changes since the last checkpoint, which a background thread runs
every ``checkpoint_interval_s`` (1 s) and which syncs the WAL to disk. ``"full"`` syncs
every commit (in a thread, grouping the calls that arrive meanwhile): nothing
acknowledged is lost even on power loss, at the price of one disk sync per group.

Restart: the snapshot is loaded, the journal rows after it are replayed through the same
code that first applied them, and each replayed reply must equal the one acknowledged
(its digest): a replay that diverges refuses to start rather than serve another state.
Snapshots are written in a thread from a copy taken between calls; a new one replaces the
old (written and synced first, then pointed to, then the old one deleted) and the journal
rows it covers are dropped.

Schema: ``PRAGMA user_version`` of every file. A newer version than this kvsvc knows is
refused with the versions in the message; an older one is migrated in place (one
transaction per step, see ``_MIGRATIONS``). ``PRAGMA application_id`` marks the files as
kvsvc's, so another SQLite file is refused as foreign, not misread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import cbor2
import xxhash

from kvsvc import __version__
from kvsvc.core.state import encode_state
from kvsvc.errors import Unavailable, quoted
from kvsvc.server.config import STATE_SYNCHRONOUS, ConfigFileError
from kvsvc.server.durability import AckedMarker, disk_full, refused_start

log = logging.getLogger("kvsvc.server")

SCHEMA_VERSION = 2
APPLICATION_ID = 0x4B565356  # "KVSV"
JOURNAL_FORMAT = "kvsvc-pool-journal"
SNAPSHOT_FORMAT = "kvsvc-pool-snapshot"
# Snapshot state is stored in rows of this size (SQLite's blobs stay well below its limit
# and a reader never holds more than the state and one row).
CHUNK_BYTES = 8 * 1024 * 1024
SYNCHRONOUS_MODES = STATE_SYNCHRONOUS
# Replay work (units of ~3 us: an operation, or 64 tokens) after which a snapshot replaces
# the journal: a restart replays about a second at most.
DEFAULT_SNAPSHOT_EVERY = 200_000


class StateError(ConfigFileError):
    """A state file that cannot be used: damaged, foreign, of a newer schema, or made for
    another plan. ``kvsvc serve`` refuses to start (exit 1) with this message."""


class JournalKind(IntEnum):
    """What one journal row replays."""

    ALLOCATE = 1  # an AllocateRequest
    FREE = 2  # a FreeRequest
    STEP = 3  # a StepRequest
    RESET = 4  # ResetPrefixCache (no payload)
    INVALIDATE = 5  # the pool's KV data is gone (payload: the reason, UTF-8)


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One call that changed the pool.

    Attributes:
        seq: position in the journal (1, 2, ...; never reused).
        kind: what ``payload`` is.
        engine: the engine namespace the call ran in ("" for the default one).
        payload: the request as it came over the wire (serialized protobuf).
        event_seq: the sequence number of the event batch the call produced (0: none).
        event_ts: that batch's timestamp.
        reply_digest: a digest of the reply the caller got (replay must reproduce it).
    """

    seq: int
    kind: int
    engine: str
    payload: bytes
    event_seq: int
    event_ts: float
    reply_digest: int

    def checksum(self) -> int:
        """A checksum of the row (signed 63 bits: SQLite's INTEGER)."""
        digest = xxhash.xxh3_64_intdigest(
            b"%d|%d|%d|%d|%r|"
            % (self.seq, self.kind, self.event_seq, self.reply_digest, self.event_ts)
            + self.engine.encode()
            + b"|"
            + self.payload
        )
        return digest >> 1


def reply_digest(data: bytes) -> int:
    """The digest a journal row keeps of a serialized reply (63 bits)."""
    return xxhash.xxh3_64_intdigest(data) >> 1


@dataclass(slots=True)
class RankRecord:
    """A rank as the state remembers it: its registration and its tensors' identity."""

    rank: int
    registration: dict[str, Any]
    allocation_id: str


@dataclass(slots=True)
class Snapshot:
    """A pool's whole state at one journal position.

    Attributes:
        identity: what the state was made for (see :meth:`PoolStore.identity`).
        generation: 1, 2, ... per store; names the file.
        journal_seq: the last journal row the state includes.
        state: the encoded core state (:func:`kvsvc.core.state.encode_state`).
        server_state: the server's own per-pool state (plain values).
        ranks: the ranks as of the snapshot.
        created_at: Unix time.
    """

    identity: dict[str, Any]
    generation: int
    journal_seq: int
    state: bytes
    server_state: dict[str, Any]
    ranks: list[RankRecord]
    created_at: float = field(default_factory=time.time)


# ------------------------------------------------------------------------------ schema


def _create_common(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
    conn.execute(
        "CREATE TABLE ranks (rank INTEGER PRIMARY KEY, registration BLOB NOT NULL, "
        "allocation_id TEXT NOT NULL)"
    )


def _create_journal_schema(conn: sqlite3.Connection) -> None:
    _create_common(conn)
    conn.execute(
        "CREATE TABLE journal (seq INTEGER PRIMARY KEY, kind INTEGER NOT NULL, "
        "engine TEXT NOT NULL, payload BLOB NOT NULL, event_seq INTEGER NOT NULL, "
        "event_ts REAL NOT NULL, reply_digest INTEGER NOT NULL, checksum INTEGER NOT NULL)"
    )


def _create_snapshot_schema(conn: sqlite3.Connection) -> None:
    _create_common(conn)
    conn.execute("CREATE TABLE chunks (n INTEGER PRIMARY KEY, data BLOB NOT NULL)")


def create_journal_schema_v1(conn: sqlite3.Connection) -> None:
    """Schema version 1 of a journal database: its rows had no checksum. Kept so the
    migration to version 2 can be exercised (tests build a version-1 file with it)."""
    _create_common(conn)
    conn.execute(
        "CREATE TABLE journal (seq INTEGER PRIMARY KEY, kind INTEGER NOT NULL, "
        "engine TEXT NOT NULL, payload BLOB NOT NULL, event_seq INTEGER NOT NULL, "
        "event_ts REAL NOT NULL, reply_digest INTEGER NOT NULL)"
    )


def _migrate_journal_v1_to_v2(conn: sqlite3.Connection) -> None:
    """Version 2 added a checksum to every journal row: compute it for the old rows."""
    conn.execute("ALTER TABLE journal ADD COLUMN checksum INTEGER NOT NULL DEFAULT 0")
    rows = conn.execute(
        "SELECT seq, kind, engine, payload, event_seq, event_ts, reply_digest FROM journal"
    ).fetchall()
    for row in rows:
        record = JournalRecord(*row)
        conn.execute(
            "UPDATE journal SET checksum = ? WHERE seq = ?", (record.checksum(), record.seq)
        )


def _migrate_snapshot_v1_to_v2(conn: sqlite3.Connection) -> None:
    """Snapshot files did not change in version 2."""


# (file kind, from version) -> the step to the next version.
_MIGRATIONS: dict[tuple[str, int], Callable[[sqlite3.Connection], None]] = {
    (JOURNAL_FORMAT, 1): _migrate_journal_v1_to_v2,
    (SNAPSHOT_FORMAT, 1): _migrate_snapshot_v1_to_v2,
}


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit)."""
    if not create and not path.exists():
        raise StateError(f"state file {path} does not exist")
    if create:
        # The hash seed of an xxh3 pool is a secret: nobody but the server reads these.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA foreign_keys = OFF")
    except sqlite3.Error as exc:
        raise StateError(f"cannot open state file {path}: {exc}") from None
    return conn


def _check_file(conn: sqlite3.Connection, path: Path, fmt: str, *, migrate: bool) -> int:
    """Check that ``path`` is a kvsvc file of format ``fmt`` and a schema this kvsvc reads;
    migrate an older schema (``migrate``). Returns the schema version it has now.

    Raises:
        StateError: not an SQLite file, not kvsvc's, damaged, of a newer schema, or of
            another format.
    """
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise StateError(
            refused_start(path.parent, exc)
            or f"{path} is not a kvsvc state file or is damaged ({exc})"
        ) from None
    if app_id != APPLICATION_ID:
        raise StateError(
            f"{path} is not a kvsvc state file (SQLite application id {app_id:#x}, "
            f"kvsvc writes {APPLICATION_ID:#x}); move it out of the state directory"
        )
    if version > SCHEMA_VERSION:
        raise StateError(
            f"{path} has state schema version {version}, newer than this kvsvc "
            f"({__version__}) reads (up to {SCHEMA_VERSION}): it was written by a newer kvsvc. "
            "Run that version (or a newer one), or move the file away to start the pool afresh"
        )
    try:
        found = conn.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        # A snapshot's content has its own checksum; reading it all twice would double a
        # restart's I/O.
        check = "ok" if fmt == SNAPSHOT_FORMAT else conn.execute("PRAGMA quick_check").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        raise StateError(refused_start(path.parent, exc) or f"{path} is damaged ({exc})") from None
    if check != "ok":
        raise StateError(f"{path} is damaged (SQLite quick_check: {check})")
    if found is None or _text(found[0]) != fmt:
        raise StateError(
            f"{path} is a kvsvc file of format {_text(found[0]) if found else None!r}, "
            f"expected {fmt!r}"
        )
    while version < SCHEMA_VERSION:
        step = _MIGRATIONS.get((fmt, version))
        if step is None or not migrate:
            raise StateError(f"{path} has state schema version {version}; cannot migrate it")
        try:
            conn.execute("BEGIN IMMEDIATE")
            step(conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            _rollback(conn)
            raise StateError(
                refused_start(path.parent, exc)
                or f"migrating {path} from schema {version} to {version + 1} failed: {exc}"
            ) from None
        version += 1
    return version


def _init_file(
    conn: sqlite3.Connection, fmt: str, create: Callable[[sqlite3.Connection], None]
) -> None:
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("BEGIN IMMEDIATE")
    create(conn)
    conn.execute("INSERT INTO meta VALUES ('format', ?)", (fmt,))
    conn.execute("INSERT INTO meta VALUES ('created_by', ?)", (__version__,))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute("COMMIT")


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite has not already (it rolls back itself on
    a full disk, and a ROLLBACK then raises "no transaction is active", which would hide
    the error that matters)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return {key: value for key, value in conn.execute("SELECT key, value FROM meta")}


def _ranks_rows(ranks: list[RankRecord]) -> list[tuple[int, str, str]]:
    return [(r.rank, json.dumps(r.registration, sort_keys=True), r.allocation_id) for r in ranks]


def _read_ranks(conn: sqlite3.Connection, path: Path) -> list[RankRecord]:
    try:
        return [
            RankRecord(rank, json.loads(registration), allocation_id)
            for rank, registration, allocation_id in conn.execute(
                "SELECT rank, registration, allocation_id FROM ranks ORDER BY rank"
            )
        ]
    except (sqlite3.Error, ValueError) as exc:
        raise StateError(f"{path}: damaged rank records ({exc})") from None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- snapshots


def write_snapshot(path: Path, snapshot: Snapshot) -> None:
    """Write ``snapshot`` to a new file at ``path`` (written under a temporary name, synced,
    then renamed, so ``path`` is either absent or complete).

    Raises:
        OSError, sqlite3.Error: the file could not be written.
    """
    staging = path.with_name(path.name + ".tmp")
    for leftover in (staging, staging.with_name(staging.name + "-journal")):
        leftover.unlink(missing_ok=True)
    conn = _connect(staging, create=True)
    try:
        _init_file(conn, SNAPSHOT_FORMAT, _create_snapshot_schema)
        meta = {
            "pool": snapshot.identity["pool"],
            "identity": json.dumps(snapshot.identity, sort_keys=True),
            "generation": snapshot.generation,
            "journal_seq": snapshot.journal_seq,
            "created_at": snapshot.created_at,
            "state_size": len(snapshot.state),
            "state_digest": xxhash.xxh3_128_hexdigest(snapshot.state),
            "server_state": cbor2.dumps(snapshot.server_state, canonical=True),
        }
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO meta VALUES (?, ?)", meta.items())
        conn.executemany("INSERT INTO ranks VALUES (?, ?, ?)", _ranks_rows(snapshot.ranks))
        view = memoryview(snapshot.state)
        conn.executemany(
            "INSERT INTO chunks VALUES (?, ?)",
            (
                (n, view[offset : offset + CHUNK_BYTES])
                for n, offset in enumerate(range(0, len(view), CHUNK_BYTES))
            ),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    _fsync_path(staging)
    os.replace(staging, path)
    _fsync_path(path.parent)


def read_snapshot(path: Path) -> Snapshot:
    """The snapshot in ``path``, checked whole (format, schema, checksum) before anything
    of it is used.

    Raises:
        StateError: a missing, foreign, damaged or newer-schema file.
    """
    conn = _connect(path, create=False)
    try:
        _check_file(conn, path, SNAPSHOT_FORMAT, migrate=True)
        meta = _read_meta(conn)
        try:
            identity = json.loads(meta["identity"])
            state = b"".join(row[0] for row in conn.execute("SELECT data FROM chunks ORDER BY n"))
            server_state = cbor2.loads(meta["server_state"])
            generation = int(meta["generation"])
            journal_seq = int(meta["journal_seq"])
            size, digest = int(meta["state_size"]), _text(meta["state_digest"])
            created_at = float(meta["created_at"])
        except (KeyError, ValueError, TypeError, sqlite3.Error, cbor2.CBORDecodeError) as exc:
            raise StateError(f"{path} is damaged: {type(exc).__name__}: {exc}") from None
        if len(state) != size or xxhash.xxh3_128_hexdigest(state) != digest:
            raise StateError(
                f"{path} is damaged: its state does not match its checksum "
                f"({len(state)} of {size} bytes)"
            )
        ranks = _read_ranks(conn, path)
    finally:
        conn.close()
    return Snapshot(identity, generation, journal_seq, state, server_state, ranks, created_at)


def snapshot_name(pool: str, generation: int) -> str:
    return f"{pool}.snapshot-{generation}.db"


# ------------------------------------------------------------------------------ journal


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
        meta = _read_meta(conn)
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
        conn = _connect(path, create=False)
        try:
            _check_file(conn, path, JOURNAL_FORMAT, migrate=True)
            _configure(conn, synchronous)
            return cls(directory, pool, conn)
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
        conn = _connect(staging, create=True)
        try:
            _init_file(conn, JOURNAL_FORMAT, _create_journal_schema)
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [
                    ("identity", json.dumps(identity, sort_keys=True)),
                    ("snapshot_generation", snapshot.generation),
                    ("snapshot_seq", snapshot.journal_seq),
                ],
            )
            conn.executemany("INSERT INTO ranks VALUES (?, ?, ?)", _ranks_rows(snapshot.ranks))
            conn.execute("COMMIT")
        finally:
            conn.close()
        _fsync_path(staging)
        os.replace(staging, path)
        _fsync_path(directory)
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

    def check_acknowledged(self) -> int | None:
        """At a restart, before anything is written: the last journal row acknowledged
        when that is beyond the journal's end (the WAL was cut: this is an earlier state
        than the one served), else None. Records the journal's end as acknowledged.

        Raises:
            StateError: the position cannot be recorded (the message says a full disk).
        """
        acknowledged = self.acked.read()
        lost = acknowledged if acknowledged is not None and acknowledged > self.last_seq else None
        if lost is None:
            self._write_acked()
        return lost

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
            StateError: missing, damaged, or another store's.
        """
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

    def ranks(self) -> list[RankRecord]:
        return _read_ranks(self._conn, self.path)

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
                conn.executemany(
                    "INSERT OR REPLACE INTO ranks VALUES (?, ?, ?)", _ranks_rows(ranks)
                )
            if snapshot is not None:
                generation, seq = snapshot
                conn.executemany(
                    "UPDATE meta SET value = ? WHERE key = ?",
                    [(generation, "snapshot_generation"), (seq, "snapshot_seq")],
                )
                conn.execute("DELETE FROM journal WHERE seq <= ?", (seq,))
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
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


def _configure(conn: sqlite3.Connection, synchronous: str) -> None:
    if synchronous not in SYNCHRONOUS_MODES:
        raise ValueError(f"state_synchronous must be one of {SYNCHRONOUS_MODES}")
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    except sqlite3.DatabaseError as exc:
        path = Path(conn.execute("PRAGMA database_list").fetchone()[2])
        raise StateError(
            refused_start(path.parent, exc) or f"cannot open the state database in WAL mode: {exc}"
        ) from None
    if mode != "wal":
        raise StateError(f"cannot put the state database in WAL mode (it is in {mode!r})")
    conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
    # Checkpoints run in a background thread (PoolStore.checkpoint), never in a commit.
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("PRAGMA journal_size_limit = 67108864")
    conn.execute("PRAGMA busy_timeout = 10000")


_INSERT_ROW = "INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?, ?, ?)"


def new_store_id() -> str:
    """Identifies one lineage of a pool's state (a restore into a new directory keeps the
    epoch but gets a new store id: its journal starts afresh)."""
    return uuid.uuid4().hex


# ------------------------------------------------------------------------- group commit


@dataclass(slots=True)
class SnapshotCapture:
    """What a snapshot is made of, copied between two calls (encoding runs later)."""

    core_state: dict[str, Any]
    server_state: dict[str, Any]
    ranks: list[RankRecord]
    journal_seq: int
    work: int = 0  # PoolPersistence.work_since_snapshot at the copy


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
        snapshot = Snapshot(
            identity=self.store.identity,
            generation=generation,
            journal_seq=capture.journal_seq,
            state=encode_state(capture.core_state),
            server_state=capture.server_state,
            ranks=capture.ranks,
        )
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
