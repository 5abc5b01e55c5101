"""What the state files cannot tell by themselves: whether the disk is full, and how far the
server had acknowledged changes.

A full disk: SQLite answers it as ``database or disk is full``, but also as ``disk I/O
error`` (its shared-memory index cannot be made) or, after it rolled a failed transaction
back itself, as ``cannot rollback - no transaction is active``. :func:`disk_full` tells the
cause from the directory's free space, so a start or a commit on a full disk says so
instead of calling the files damaged.

The acknowledged position (``<pool>.acked``): after each commit the store writes the last
journal row it committed there (no sync: it is in the page cache as soon as the WAL is, so a
killed process leaves both; a power loss may leave either). If a restart finds the journal
ends before that row, the WAL was cut (a power loss in ``normal`` mode, a damaged or
truncated file): the state is an earlier one than subscribers saw, and its event sequence
numbers after that point were handed out already, so the pool gets a new epoch. A marker
that is missing, garbage or another lineage's tells nothing, so the state cannot be shown
whole: it gets a new epoch too (never earlier state under the same epoch).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from pathlib import Path

# Less free space than this when a write failed: the disk is full (SQLite needs room for a
# few pages and its -shm index; a filesystem keeps some blocks back from non-root users).
FULL_BELOW_BYTES = 1 << 20
_ID_WIDTH = 32  # a store id: uuid4 hex
_SEQ_WIDTH = 20  # a journal position: up to 2^64
ACKED_SUFFIX = ".acked"


def free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use in ``directory`` (None: unknown)."""
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def disk_full(directory: Path, error: BaseException | None = None) -> str | None:
    """Says the disk of ``directory`` is full when ``error`` (or, without one, the free
    space alone) says so; None otherwise."""
    says_full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(error, sqlite3.Error):
        says_full = getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    free = free_bytes(directory)
    if not says_full and (free is None or free >= FULL_BELOW_BYTES):
        return None
    room = f"{free} bytes free" if free is not None else "no room"
    return f"the disk of state_dir {directory} is full ({room})"


def refused_start(directory: Path, error: BaseException) -> str | None:
    """What a start refused by a full disk says (None: not a full disk)."""
    full = disk_full(directory, error)
    return f"{full}: free space on it, then start the server again" if full else None


def acked_path(journal: Path) -> Path:
    """``DIR/<pool>.acked`` beside ``DIR/<pool>.db``."""
    return journal.with_suffix(ACKED_SUFFIX)


class AckedMarker:
    """The last committed journal row of one store lineage, kept beside its journal."""

    def __init__(self, journal: Path, store_id: str) -> None:
        self.path = acked_path(journal)
        self.store_id = store_id
        self._fd: int | None = None

    def read(self) -> int | None:
        """The position the marker holds for this store (None: absent, unreadable, or
        another lineage's: nothing can be told then)."""
        return self.read_checked()[0]

    def read_checked(self) -> tuple[int | None, str | None]:
        """The position the marker holds for this store, or why it holds none: a line
        that says what is wrong with the file (missing, unreadable, garbage, another
        lineage's), for a restart to say why it cannot trust the state's epoch."""
        try:
            text = self.path.read_bytes().decode("ascii")
        except FileNotFoundError:
            return None, f"{self.path} is missing"
        except OSError as exc:
            return None, f"{self.path} cannot be read ({exc.strerror})"
        except UnicodeDecodeError:
            return None, f"{self.path} is damaged (not text)"
        parts = text.split()
        if len(parts) != 2 or not parts[1].isdigit() or len(parts[1]) > _SEQ_WIDTH:
            return None, f"{self.path} is damaged (it holds {text[:60]!r}, not a position)"
        if parts[0] != self.store_id:
            return None, (
                f"{self.path} is another state's (store id {parts[0][:_ID_WIDTH]}, this "
                f"state's {self.store_id})"
            )
        return int(parts[1]), None

    def write(self, seq: int) -> None:
        """Record ``seq`` as committed (one ``pwrite`` of a fixed-size line, no sync).

        Raises:
            OSError: it could not be written (the caller's commit fails with it).
        """
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        line = f"{self.store_id:<{_ID_WIDTH}} {seq:0{_SEQ_WIDTH}d}\n".encode()
        os.pwrite(self._fd, line, 0)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
