"""Listening addresses that cannot be bound, reported as one line each naming the flag to
change.

A port someone else holds is the most common start-up failure of every command that
listens (``kvsvc serve``, ``worker --metrics-listen``, ``demo``, ``indexer``, ``router``).
Left alone it surfaces as gRPC's ``RuntimeError: Failed to bind to address ...`` (after a
C-core log line and a traceback) or as a bare ``[Errno 98] Address already in use`` that
does not say which of two listeners failed. :func:`check_listeners` tries every address a
command will listen on with a throwaway socket first, so the common case fails before
anything starts and names each taken address at once (not one per attempt), and
:class:`ListenError` carries the lines every command prints: the address, what it was
for, and the flag that moves it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class ListenError(OSError):
    """An address a listener cannot bind; ``str()`` is the whole message for the user.

    Attributes:
        address: the address as the user gave it (``HOST:PORT``).
        flag: the command-line flag (or setting) that chooses it, e.g. ``--listen``.
    """

    def __init__(
        self, address: str, what: str, flag: str, cause: OSError | str, *, held: bool = True
    ) -> None:
        """``held``: another process holds the address (the message says to stop it);
        False when the command itself would take it twice."""
        reason = cause if isinstance(cause, str) else _reason(cause)
        advice = "stop what holds it, or choose" if held else "choose"
        super().__init__(
            f"cannot listen on {address} ({what}): {reason}; {advice} another address with {flag}"
        )
        self.address = address
        self.flag = flag
        self.errors: tuple[ListenError, ...] = (self,)

    @classmethod
    def of(cls, errors: Sequence[ListenError]) -> ListenError:
        """One error for ``errors`` (at least one): ``str()`` has a line per address."""
        if len(errors) == 1:
            return errors[0]
        combined = cls.__new__(cls)
        OSError.__init__(combined, "\n".join(str(e) for e in errors))
        combined.address, combined.flag = errors[0].address, errors[0].flag
        combined.errors = tuple(errors)
        return combined

    def report(self, prog: str) -> str:
        """The lines a command prints, each starting with ``prog`` (``kvsvc serve: ...``)."""
        return "\n".join(f"{prog}: {e}" for e in self.errors)


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


@dataclass(frozen=True, slots=True)
class Listener:
    """An address a command is about to listen on, for :func:`check_listeners`.

    Attributes:
        address: as the user wrote it (``HOST:PORT``, ``unix:PATH``, a ZMQ ``tcp://``
            endpoint), for the message.
        what: what listens there, e.g. ``"gRPC"`` or ``"/metrics"``.
        flag: the flag (and config key) that chooses the address.
        host / port: the TCP address to bind; None for a ``unix:PATH`` address.
    """

    address: str
    what: str
    flag: str
    host: str | None = None
    port: int | None = None


_WILDCARDS = ("", "0.0.0.0", "::", "*")


def _same_port(a: Listener, b: Listener) -> bool:
    """Whether binding ``a`` and then ``b`` collide: one port, the same or a wildcard host."""
    if a.host is None or b.host is None:
        return a.host is None and b.host is None and unix_path(a.address) == unix_path(b.address)
    return (
        bool(a.port)
        and a.port == b.port
        and (a.host == b.host or a.host in _WILDCARDS or b.host in _WILDCARDS)
    )


def check_listeners(listeners: Iterable[Listener]) -> None:
    """Try every address a command will listen on, before it starts anything.

    Raises:
        ListenError: naming each address that cannot be bound now (another process holds
            it, or an earlier listener of the same command takes it), one line each.
    """
    errors: list[ListenError] = []
    checked: list[Listener] = []
    for listener in listeners:
        first = next((c for c in checked if _same_port(c, listener)), None)
        if first is not None:
            errors.append(
                ListenError(
                    listener.address,
                    listener.what,
                    listener.flag,
                    f"{first.address} ({first.what}) takes it already",
                    held=False,
                )
            )
            continue
        try:
            if listener.host is None:
                check_unix_bindable(listener.address, what=listener.what, flag=listener.flag)
            else:
                check_bindable(
                    listener.host,
                    listener.port or 0,
                    address=listener.address,
                    what=listener.what,
                    flag=listener.flag,
                )
        except ListenError as exc:
            errors.append(exc)
            continue
        checked.append(listener)
    if errors:
        raise ListenError.of(errors)


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
