"""A snapshot file (``DIR/<pool>.snapshot-<N>.db``): a pool's whole state at one journal
position, written whole under a temporary name and renamed, read back and checked whole
(format, schema, checksum) before anything of it is used.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

import cbor2
import xxhash

from kvsvc.server.persistence.records import Snapshot, StateError
from kvsvc.server.persistence.schema import (
    SNAPSHOT_FORMAT,
    check_file,
    connect,
    create_snapshot_schema,
    fsync_path,
    init_file,
    meta_text,
    ranks_rows,
    read_meta,
    read_ranks,
)

# Snapshot state is stored in rows of this size (SQLite's blobs stay well below its limit
# and a reader never holds more than the state and one row).
CHUNK_BYTES = 8 * 1024 * 1024


def write_snapshot(path: Path, snapshot: Snapshot) -> None:
    """Write ``snapshot`` to a new file at ``path`` (written under a temporary name, synced,
    then renamed, so ``path`` is either absent or complete).

    Raises:
        OSError, sqlite3.Error: the file could not be written.
    """
    staging = path.with_name(path.name + ".tmp")
    for leftover in (staging, staging.with_name(staging.name + "-journal")):
        leftover.unlink(missing_ok=True)
    conn = connect(staging, create=True)
    try:
        init_file(conn, SNAPSHOT_FORMAT, create_snapshot_schema)
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
        conn.executemany("INSERT INTO ranks VALUES (?, ?, ?)", ranks_rows(snapshot.ranks))
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
    fsync_path(staging)
    os.replace(staging, path)
    fsync_path(path.parent)


def read_snapshot(path: Path) -> Snapshot:
    """The snapshot in ``path``, checked whole (format, schema, checksum) before anything
    of it is used.

    Raises:
        StateError: a missing, foreign, damaged or newer-schema file.
    """
    conn = connect(path, create=False)
    try:
        check_file(conn, path, SNAPSHOT_FORMAT, migrate=True)
        meta = read_meta(conn)
        try:
            identity = json.loads(meta["identity"])
            state = b"".join(row[0] for row in conn.execute("SELECT data FROM chunks ORDER BY n"))
            server_state = cbor2.loads(meta["server_state"])
            generation = int(meta["generation"])
            journal_seq = int(meta["journal_seq"])
            size, digest = int(meta["state_size"]), meta_text(meta["state_digest"])
            created_at = float(meta["created_at"])
        except (KeyError, ValueError, TypeError, sqlite3.Error, cbor2.CBORDecodeError) as exc:
            raise StateError(f"{path} is damaged: {type(exc).__name__}: {exc}") from None
        if len(state) != size or xxhash.xxh3_128_hexdigest(state) != digest:
            raise StateError(
                f"{path} is damaged: its state does not match its checksum "
                f"({len(state)} of {size} bytes)"
            )
        ranks = read_ranks(conn, path)
    finally:
        conn.close()
    return Snapshot(identity, generation, journal_seq, state, server_state, ranks, created_at)


def read_snapshot_identity(path: Path) -> dict[str, Any]:
    """What the snapshot in ``path`` was made for (its pool, settings and plan inputs),
    without reading its state: ``kvsvc serve --restore`` configures the pool from it.

    Raises:
        StateError: a missing, foreign, damaged or newer-schema file.
    """
    conn = connect(path, create=False)
    try:
        check_file(conn, path, SNAPSHOT_FORMAT, migrate=True)
        try:
            identity = json.loads(read_meta(conn)["identity"])
        except (KeyError, ValueError, TypeError, sqlite3.Error) as exc:
            raise StateError(f"{path} is damaged: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    if not isinstance(identity, dict):
        raise StateError(f"{path} is damaged: its identity is not a JSON object")
    return identity


def snapshot_name(pool: str, generation: int) -> str:
    return f"{pool}.snapshot-{generation}.db"
