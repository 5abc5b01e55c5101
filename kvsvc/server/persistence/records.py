"""The records a pool's saved state is made of, as plain data: journal rows, rank records,
snapshots and the copy a snapshot is made from, and the one error every unusable state raises.

Nothing here touches a file: :mod:`kvsvc.server.persistence.schema` and the stores write
and read these records.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import xxhash

from kvsvc.core.state import encode_state
from kvsvc.server.config import ConfigFileError


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


@dataclass(slots=True)
class SnapshotCapture:
    """What a snapshot is made of, copied between two calls (encoding runs later)."""

    core_state: dict[str, Any]
    server_state: dict[str, Any]
    ranks: list[RankRecord]
    journal_seq: int
    work: int = 0  # PoolPersistence.work_since_snapshot at the copy

    def to_snapshot(self, identity: dict[str, Any], generation: int) -> Snapshot:
        """The snapshot of this copy (encodes the core state: run it off the loop)."""
        return Snapshot(
            identity=identity,
            generation=generation,
            journal_seq=self.journal_seq,
            state=encode_state(self.core_state),
            server_state=self.server_state,
            ranks=self.ranks,
        )


def new_store_id() -> str:
    """Identifies one lineage of a pool's state (a restore into a new directory keeps the
    epoch but gets a new store id: its journal starts afresh)."""
    return uuid.uuid4().hex
