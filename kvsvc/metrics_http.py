"""The ``/metrics`` endpoint of the server and of the worker agent: HTTP, or HTTPS with TLS.

prometheus_client's ``start_http_server`` can serve HTTPS, but it wraps the *listening*
socket, so every TLS handshake runs in its one accept thread: a single client that opens
a connection and sends nothing stalls the endpoint for every scraper. Here the accept loop
only accepts; each connection's handshake and request run in that connection's own thread,
and a refused handshake (plain HTTP on an HTTPS port, an untrusted or missing client
certificate) closes that connection only. The certificate comes from a
:class:`kvsvc.tls.ServerTlsSource`, so a renewed one is picked up by the next connection.

Connections are bounded in time and number, with or without TLS: a connection whose
handshake or request stalls for :attr:`MetricsHTTPServer.timeout_s` seconds is dropped, and
past :attr:`MetricsHTTPServer.max_connections` open at once a new one is closed at once
(one thread each: a client opening thousands must not start thousands of threads).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvsvc.tls import ServerTlsSource

# A handshake or a read of a request that takes longer than this drops the connection.
CONNECTION_TIMEOUT_S = 10.0
# Connections served at once (each has a thread); Prometheus needs one per scraper.
MAX_CONNECTIONS = 64


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (scrapes every few seconds would drown the real log)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsHTTPServer(ThreadingWSGIServer):
    """A threaded WSGI server whose connections do their own TLS handshake, each bounded in
    time, and at most ``max_connections`` of them at once."""

    tls: ServerTlsSource | None = None
    timeout_s: float = CONNECTION_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    # The listen backlog (socketserver's default is 5): past it the kernel holds a
    # client's handshake back and retries it after a second or more, so a burst of
    # connections (a flood, or many scrapers at once) made every connection past the
    # fifth wait ~1-3 s before it was even accepted, to be served or refused.
    request_queue_size = 128

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start the connection's thread if a slot is free; close it otherwise."""
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: the slot is still ours
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.timeout_s)
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            # On failure the socket is closed with the wrapper (ssl.SSLError is an OSError).
            secure = self.tls.ssl_context().wrap_socket(request, server_side=True)
        except OSError:
            return
        try:
            super().finish_request(secure, client_address)
        finally:
            with contextlib.suppress(OSError):  # the client may be gone already
                secure.shutdown(socket.SHUT_RDWR)
            secure.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-request is no error worth a traceback on stderr."""


def _family(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family and address to bind ``host`` with (IPv6 hosts included)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    return family, str(sockaddr[0])


def serve_metrics_http(
    host: str,
    port: int,
    registry: CollectorRegistry,
    tls: ServerTlsSource | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``http(s)://HOST:PORT/metrics`` from a daemon thread.

    Args:
        host / port: where to listen (port 0: a free port, see ``server.server_port``).
        registry: what to expose.
        tls: serve HTTPS with this certificate (and require client certificates when it
            has a client CA); None for plain HTTP.

    Returns:
        The server (``shutdown()`` then ``server_close()`` stops it) and its thread.

    Raises:
        OSError: the address cannot be bound.
    """
    family, address = _family(host, port)

    class Server(MetricsHTTPServer):
        address_family = family

    Server.tls = tls
    server = Server((address, port), _QuietHandler)
    server.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=server.serve_forever, name="kvsvc-metrics", daemon=True)
    thread.start()
    return server, thread
