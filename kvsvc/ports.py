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

import errno
import socket


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
