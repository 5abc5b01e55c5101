"""Listening addresses that cannot be bound, reported as one line naming the flag to change.

A port someone else holds is the most common start-up failure of ``kvsvc serve``, ``kvsvc
worker --metrics-listen`` and ``kvsvc demo``. Left alone it surfaces as gRPC's
``RuntimeError: Failed to bind to address ...`` (after a C-core log line and a traceback)
or as a bare ``[Errno 98] Address already in use`` that does not say which of two
listeners failed. :func:`check_bindable` tries the address with a throwaway socket first,
so the common case fails before anything starts, and :class:`ListenError` carries the one
line every command prints: the address, what it was for, and the flag that moves it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
from collections.abc import Iterator


class ListenError(OSError):
    """An address a listener cannot bind; ``str()`` is the whole message for the user.

    Attributes:
        address: the address as the user gave it (``HOST:PORT``).
        flag: the command-line flag (or setting) that chooses it, e.g. ``--listen``.
    """

    def __init__(self, address: str, what: str, flag: str, cause: OSError | str) -> None:
        reason = cause if isinstance(cause, str) else _reason(cause)
        super().__init__(
            f"cannot listen on {address} ({what}): {reason}; stop what holds it, or choose "
            f"another address with {flag}"
        )
        self.address = address
        self.flag = flag


def _reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "the address is already in use"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "no such address on this machine"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    return exc.strerror or str(exc)


def check_bindable(host: str, port: int, *, address: str, what: str, flag: str) -> None:
    """Raise :class:`ListenError` when ``host:port`` cannot be bound now.

    Binds and closes a socket with ``SO_REUSEADDR``, as gRPC's and the ``/metrics``
    listeners do, so a port in ``TIME_WAIT`` passes and one another process listens on
    fails. Port 0 always passes (the listener takes a free port). This is a check ahead of
    the real bind, not a reservation: whoever binds it in between still makes the real
    bind fail, which the callers report the same way.

    Args:
        host / port: what the listener will bind.
        address: the address as the user wrote it (for the message).
        what: what listens there, e.g. ``"gRPC"`` or ``"/metrics"``.
        flag: the flag that chooses the address, e.g. ``"--metrics-listen"``.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(
            address, what, flag, f"cannot resolve {host!r} ({exc.strerror})"
        ) from None
    family, socktype, proto, _, sockaddr = infos[0]
    with socket.socket(family, socktype, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise ListenError(address, what, flag, exc) from None


# The address form of a Unix-domain socket, as gRPC spells it (``unix:PATH``).
UNIX_PREFIX = "unix:"
# sun_path holds 108 bytes on Linux, the terminating NUL included.
MAX_UNIX_PATH_BYTES = 107


def is_unix_address(address: str) -> bool:
    """Whether ``address`` names a Unix-domain socket (``unix:PATH``) rather than a
    ``HOST:PORT``."""
    return address.startswith(UNIX_PREFIX)


def unix_path(address: str) -> str:
    """The socket path of a ``unix:PATH`` address (``unix:///abs`` too, as gRPC takes it)."""
    path = address[len(UNIX_PREFIX) :]
    return "/" + path.lstrip("/") if path.startswith("//") else path


def check_unix_bindable(address: str, *, what: str, flag: str) -> None:
    """Raise :class:`ListenError` when the socket of ``address`` (``unix:PATH``) cannot be
    made now.

    gRPC unlinks whatever socket is at the path before it binds, so a second server on a
    path a live one serves would take it over without a word and the first would stop
    getting calls: a socket that accepts a connection is reported as in use. A socket
    nothing accepts on (left by a process that was killed) is stale and is replaced. Any
    other file, a missing directory and a path too long for ``sun_path`` are refused.
    """
    path = unix_path(address)
    if not path:
        raise ListenError(address, what, flag, "no socket path after 'unix:'")
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        raise ListenError(
            address, what, flag, f"the path is longer than {MAX_UNIX_PATH_BYTES} bytes"
        )
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise ListenError(address, what, flag, f"no such directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ListenError(address, what, flag, f"permission denied in {directory}")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenError(address, what, flag, "the path exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return  # stale: nothing accepts on it
    raise ListenError(address, what, flag, "a running server listens on this socket")


# The mode of the Unix sockets a server listens on, unless configured: the owner only.
DEFAULT_UNIX_SOCKET_MODE = 0o600


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """While a listener creates its Unix socket: the socket file is the owner's alone
    whatever the process's umask, until :func:`set_unix_socket_mode` gives it its
    configured mode (connecting needs write permission on the file).

    The umask is the process's, so files other threads create meanwhile are made with it
    too: 077 only takes permissions away from them (directories keep their owner's
    rwx), never the other way round.
    """
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def set_unix_socket_mode(address: str, mode: int) -> None:
    """Give the socket of ``address`` (``unix:PATH``) its configured ``mode``; the mode is
    set on the file itself, so it does not depend on the umask (a 000 umask made the
    sockets world-writable: anyone on the host could connect)."""
    os.chmod(unix_path(address), mode)
