"""Tests take free ports: kvsvc's default ports are held while the suite runs.

A test server that keeps a default address (``ServerConfig()``'s ``/metrics`` on
127.0.0.1:9400, ``kvsvc serve`` without ``--listen``) passes only while nothing else on
the machine holds that port, and fails on a machine where something does: a CI run once
failed that way. tests/conftest.py holds every default address for the whole session with
:class:`DefaultPortHolder`, so such a test fails on every run, naming the address, instead
of on some machines. (Where another process holds a port already, it is held all the same,
and taken by the suite once that process lets go.)

A client that dials a held address (``kvsvc ctl`` without ``--server``) has its connection
accepted and closed at once: it fails as fast as against a closed port.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from kvsvc.cluster.commands import DEFAULT_INDEXER_METRICS, DEFAULT_ROUTER_LISTEN
from kvsvc.server.config import DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN, split_host_port

# Every address a kvsvc process binds when not told otherwise.
DEFAULT_ADDRESSES = (
    DEFAULT_LISTEN,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_INDEXER_METRICS,
    DEFAULT_ROUTER_LISTEN,
)


class DefaultPortHolder:
    """Listens on the given addresses (those it can bind) and closes what connects."""

    def __init__(self, addresses: tuple[str, ...] = DEFAULT_ADDRESSES) -> None:
        self.sockets: list[socket.socket] = []
        self.held_elsewhere: list[str] = []
        for address in addresses:
            sock = self._bind(address)
            if sock is None:
                self.held_elsewhere.append(address)  # in use already: held all the same
            else:
                self.sockets.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refuse, name="default-ports", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(address: str) -> socket.socket | None:
        host, port = split_host_port(address, "default address")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # SO_REUSEADDR only (past TIME_WAIT); never SO_REUSEPORT, which gRPC sets and
        # which would let a test's server share the port instead of being refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            return None
        sock.listen(64)
        sock.setblocking(False)
        return sock

    def _refuse(self) -> None:
        with selectors.DefaultSelector() as selector:
            for sock in self.sockets:
                selector.register(sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.2):
                    with contextlib.suppress(OSError):
                        conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                        conn.close()
                # An address another process held (another test session, say) is taken
                # once it lets go, so it stays held for the rest of this session.
                for address in list(self.held_elsewhere):
                    sock = self._bind(address)
                    if sock is not None:
                        self.held_elsewhere.remove(address)
                        self.sockets.append(sock)
                        selector.register(sock, selectors.EVENT_READ)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.sockets:
            sock.close()
