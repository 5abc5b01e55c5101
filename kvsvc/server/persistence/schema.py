"""The SQLite file format both kinds of state file share (the journal database and the
snapshots): their application id and schema version, the tables of each version and the
migrations between them, and opening, checking and tuning a file.

``PRAGMA user_version`` of every file is its schema version. A newer version than this
kvsvc knows is refused with the versions in the message; an older one is migrated in place
(one transaction per step, see ``_MIGRATIONS``). ``PRAGMA application_id`` marks the files
as kvsvc's, so another SQLite file is refused as foreign, not misread.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsvc import __version__
from kvsvc.server.config import STATE_SYNCHRONOUS
from kvsvc.server.persistence.durability import refused_start
from kvsvc.server.persistence.records import JournalRecord, RankRecord, StateError

SCHEMA_VERSION = 2
APPLICATION_ID = 0x4B565356  # "KVSV"
JOURNAL_FORMAT = "kvsvc-pool-journal"
SNAPSHOT_FORMAT = "kvsvc-pool-snapshot"
SYNCHRONOUS_MODES = STATE_SYNCHRONOUS


def _create_common_tables(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
    conn.execute(
        "CREATE TABLE ranks (rank INTEGER PRIMARY KEY, registration BLOB NOT NULL, "
        "allocation_id TEXT NOT NULL)"
    )


def create_journal_schema(conn: sqlite3.Connection) -> None:
    _create_common_tables(conn)
    conn.execute(
        "CREATE TABLE journal (seq INTEGER PRIMARY KEY, kind INTEGER NOT NULL, "
        "engine TEXT NOT NULL, payload BLOB NOT NULL, event_seq INTEGER NOT NULL, "
        "event_ts REAL NOT NULL, reply_digest INTEGER NOT NULL, checksum INTEGER NOT NULL)"
    )


def create_snapshot_schema(conn: sqlite3.Connection) -> None:
    _create_common_tables(conn)
    conn.execute("CREATE TABLE chunks (n INTEGER PRIMARY KEY, data BLOB NOT NULL)")


def create_journal_schema_v1(conn: sqlite3.Connection) -> None:
    """Schema version 1 of a journal database: its rows had no checksum. Kept so the
    migration to version 2 can be exercised (tests build a version-1 file with it)."""
    _create_common_tables(conn)
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


def connect(path: Path, *, create: bool) -> sqlite3.Connection:
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


def check_file(conn: sqlite3.Connection, path: Path, fmt: str, *, migrate: bool) -> int:
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
    if found is None or meta_text(found[0]) != fmt:
        raise StateError(
            f"{path} is a kvsvc file of format {meta_text(found[0]) if found else None!r}, "
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
            rollback(conn)
            raise StateError(
                refused_start(path.parent, exc)
                or f"migrating {path} from schema {version} to {version + 1} failed: {exc}"
            ) from None
        version += 1
    return version


def init_file(
    conn: sqlite3.Connection, fmt: str, create: Callable[[sqlite3.Connection], None]
) -> None:
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("BEGIN IMMEDIATE")
    create(conn)
    conn.execute("INSERT INTO meta VALUES ('format', ?)", (fmt,))
    conn.execute("INSERT INTO meta VALUES ('created_by', ?)", (__version__,))
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute("COMMIT")


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the open transaction, if SQLite has not already (it rolls back itself on
    a full disk, and a ROLLBACK then raises "no transaction is active", which would hide
    the error that matters)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def meta_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return {key: value for key, value in conn.execute("SELECT key, value FROM meta")}


def ranks_rows(ranks: list[RankRecord]) -> list[tuple[int, str, str]]:
    return [(r.rank, json.dumps(r.registration, sort_keys=True), r.allocation_id) for r in ranks]


def read_ranks(conn: sqlite3.Connection, path: Path) -> list[RankRecord]:
    try:
        return [
            RankRecord(rank, json.loads(registration), allocation_id)
            for rank, registration, allocation_id in conn.execute(
                "SELECT rank, registration, allocation_id FROM ranks ORDER BY rank"
            )
        ]
    except (sqlite3.Error, ValueError) as exc:
        raise StateError(f"{path}: damaged rank records ({exc})") from None


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def configure_wal(conn: sqlite3.Connection, synchronous: str) -> None:
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
