"""Telling a damaged write-ahead log from one that simply ends.

SQLite reads a WAL frame by frame and stops at the first frame whose checksum (cumulative
over every frame before it) or salts do not match: what follows is, to it, not there. A
torn last frame (a crash in the middle of a write) ends a WAL that way and loses nothing
acknowledged; a flipped bit in an earlier frame ends it the same way and silently drops
every commit after it. The journal then reads as an earlier state, whose snapshot pointer
may name a file already replaced, or whose pages no longer fit those already checkpointed
into the database: without this module the start reported only those consequences ("the
snapshot does not exist", "malformed").

:func:`wal_damage` checks the checksums the way SQLite does and says which frame broke,
when frames of the same WAL generation (same salts) follow it. It reads the whole file
(~50 us per 4 KiB frame), so the stores call it only on the way to an error.

Format (https://www.sqlite.org/fileformat2.html#walformat): a 32-byte header (magic,
version, page size, checkpoint sequence, two salts, two checksum words), then frames of a
24-byte header (page number, database size after a commit or 0, the salts, two checksum
words) and one page.
"""

from __future__ import annotations

import struct
from pathlib import Path

_MAGIC = 0x377F0682  # the low bit says the checksum words' byte order (1: big-endian)
_HEADER = 32
_FRAME_HEADER = 24
_MASK = 0xFFFFFFFF


def _checksum(data: bytes, big_endian: bool, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continuing ``s0, s1``."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & _MASK
        s1 = (s1 + words[i + 1] + s0) & _MASK
    return s0, s1


def wal_path(database: Path) -> Path:
    """``<db>-wal`` beside ``database``."""
    return database.with_name(database.name + "-wal")


def wal_damage(database: Path) -> str | None:
    """What is wrong with ``database``'s WAL, when SQLite would stop reading it before
    frames that belong to it (a damaged frame with later frames of the same generation
    behind it); None when it is absent, empty, or ends cleanly (a torn last frame
    included: nothing after it was ever committed).
    """
    path = wal_path(database)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _HEADER:
        return None
    magic, _, page_size, _, salt1, salt2, c0, c1 = struct.unpack(">8I", data[:_HEADER])
    frame_size = _FRAME_HEADER + page_size
    num_frames = (len(data) - _HEADER) // frame_size if page_size else 0
    if magic & ~1 != _MAGIC or not 512 <= page_size <= 65536 or page_size & (page_size - 1):
        if num_frames:
            return (
                f"{path.name} is damaged: its header is not a WAL header, so SQLite "
                f"ignores all {num_frames} frames of it"
            )
        return None
    big_endian = bool(magic & 1)
    s0, s1 = _checksum(data[:24], big_endian, 0, 0)
    if (s0, s1) != (c0, c1):
        return (
            f"{path.name} is damaged: its header fails its checksum, so SQLite ignores all "
            f"{num_frames} frames of it"
        )

    def salted(index: int) -> bool:
        at = _HEADER + index * frame_size
        return struct.unpack(">2I", data[at + 8 : at + 16]) == (salt1, salt2)

    for index in range(num_frames):
        at = _HEADER + index * frame_size
        page, _, f_salt1, f_salt2, f0, f1 = struct.unpack(">6I", data[at : at + _FRAME_HEADER])
        if (f_salt1, f_salt2) != (salt1, salt2):
            return None  # a frame of an earlier generation: this one ended before it
        s0, s1 = _checksum(data[at : at + 8], big_endian, s0, s1)
        s0, s1 = _checksum(data[at + _FRAME_HEADER : at + frame_size], big_endian, s0, s1)
        if (s0, s1) != (f0, f1):
            later = sum(1 for i in range(index + 1, num_frames) if salted(i))
            if not later:
                return None  # a torn last write: never committed
            return (
                f"{path.name} is damaged: frame {index + 1} of {num_frames} (database page "
                f"{page}) fails its checksum, so SQLite stops reading there and the "
                f"{later} frames of this log after it, with the commits they hold, are lost"
            )
    return None
