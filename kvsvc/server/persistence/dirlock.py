"""One server per state directory: an exclusive lock on ``DIR/kvsvc.lock``.

Two servers on one directory would each serve their own copy of the pools' state and, on
their next snapshot, write it over the other's: whichever wrote first then answered
``IntegrityError ... fix the disk`` until restarted. The first server takes an exclusive
``flock`` on the lock file and keeps it open while it runs; a second one is refused with
the holder's pid and listen address (which the holder writes into the file).

``flock`` rather than a pid file: the kernel drops the lock with the last descriptor of
the process that holds it, so a server killed with SIGKILL leaves no stale lock, and the
directory is usable again at once. It is also per open file (not per process, as POSIX
``fcntl`` locks are), so two servers in one process (tests) exclude each other too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from kvsvc.server.persistence.records import StateError

LOCK_NAME = "kvsvc.lock"
# The holder's description is short (pid, addresses, time): read at most this much of it.
_MAX_HOLDER_BYTES = 4096


class StateDirInUse(StateError):
    """The state directory is locked by another running server (``kvsvc serve`` exits 1)."""


class StateDirLock:
    """The lock of one state directory, held from :meth:`acquire` until :meth:`release`
    (or the process's end, whatever ends it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path, listen: str) -> StateDirLock:
        """Lock ``directory`` for this process, which listens on ``listen``.

        Raises:
            StateDirInUse: another server holds it (the message names its pid and address).
            OSError: the lock file cannot be opened.
        """
        path = directory / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(_read_holder(fd))
            os.close(fd)
            raise StateDirInUse(
                f"state_dir {directory} is in use by another kvsvc server ({holder}): two "
                "servers on one state directory overwrite each other's state. Stop that "
                "server first, or give this one another --state-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd)
        lock.describe(listen)
        return lock

    def describe(self, listen: str) -> None:
        """Write who holds the lock (read by a server that is refused): best effort, the
        lock itself is what excludes."""
        if self._fd is None:
            return
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data = json.dumps({"pid": os.getpid(), "listen": listen, "since": since}).encode()
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data + b"\n", 0)

    def release(self) -> None:
        """Unlock (closing the file drops the lock); the file stays for the next holder."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, _MAX_HOLDER_BYTES, 0))
    except (OSError, ValueError):  # being rewritten right now, or not ours
        return {}
    return data if isinstance(data, dict) else {}


def _describe_holder(holder: dict[str, Any]) -> str:
    pid = holder.get("pid")
    listen = holder.get("listen")
    parts = [f"pid {pid}" if isinstance(pid, int) else "pid unknown"]
    if isinstance(listen, str) and listen:
        parts.append(f"listening on {listen}")
    since = holder.get("since")
    if isinstance(since, str) and since:
        parts.append(f"since {since}")
    return ", ".join(parts)
