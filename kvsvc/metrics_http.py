"""The ``/metrics`` endpoint of the server and of the worker agent: HTTP, or HTTPS with TLS.

prometheus_client's ``start_http_server`` can serve HTTPS, but it wraps the *listening*
socket, so every TLS handshake runs in its one accept thread: a single client that opens
a connection and sends nothing stalls the endpoint for every scraper. Here the accept loop
only accepts; each connection's handshake (bounded by :data:`HANDSHAKE_TIMEOUT_S`) and
request run in that connection's own thread, and a refused handshake (plain HTTP on an
HTTPS port, an untrusted or missing client certificate) closes that connection only.
The certificate comes from a :class:`kvsvc.tls.ServerTlsSource`, so a renewed one is
picked up by the next connection.
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

# A handshake (and each read of a request) that takes longer than this is dropped.
HANDSHAKE_TIMEOUT_S = 10.0


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (scrapes every few seconds would drown the real log)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsHTTPServer(ThreadingWSGIServer):
    """A threaded WSGI server whose connections do their own TLS handshake."""

    tls: ServerTlsSource | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT_S)
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
