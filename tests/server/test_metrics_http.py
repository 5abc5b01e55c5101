"""kvsvc.metrics_http: the /metrics server bounds each connection in time and all of them
in number, with or without TLS (an idle or slow client must not pin a thread for ever, and
a flood of connections must not start a thread each)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge

from kvsvc.metrics_http import MetricsHTTPServer, serve_metrics_http

# The endpoint fixture's server, for a test that must see how many slots are taken.
servers: list[MetricsHTTPServer] = []


def free_slots(server: MetricsHTTPServer) -> int:
    return int(server._slots._value)  # type: ignore[attr-defined]


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    # Long enough that "closed at once" (past the cap) and "closed at the timeout" (idle)
    # stay apart on a loaded machine.
    monkeypatch.setattr(MetricsHTTPServer, "timeout_s", 3.0)
    monkeypatch.setattr(MetricsHTTPServer, "max_connections", 3)
    registry = CollectorRegistry()
    Gauge("probe_value", "A value to find.", registry=registry).set(7)
    server, thread = serve_metrics_http("127.0.0.1", 0, registry)
    servers.append(server)
    yield int(server.server_port)
    server.shutdown()
    server.server_close()
    thread.join(5)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_connections_past_the_cap_are_closed_and_start_no_thread(endpoint: int) -> None:
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", endpoint)) for _ in range(3)]
    # The server takes the three slots in its own thread: on a loaded machine that can
    # take a while, and a flood that came first would get a slot instead.
    deadline = time.monotonic() + 10
    while free_slots(servers[-1]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert free_slots(servers[-1]) == 0
    started = time.monotonic()
    flood = [socket.create_connection(("127.0.0.1", endpoint)) for _ in range(20)]
    try:
        assert all(closed_by_server(s, 2.5) for s in flood)
        assert time.monotonic() - started < 2.5, "past the cap: closed at once, not timed out"
        assert threading.active_count() - before <= 3
    finally:
        for sock in flood:
            sock.close()
    # The idle ones are dropped after the timeout; then scrapes are served again.
    try:
        assert all(closed_by_server(s, 10.0) for s in idle)
    finally:
        for sock in idle:
            sock.close()
    assert "probe_value 7.0" in scrape(endpoint)


def test_a_slow_request_is_dropped_after_the_timeout(endpoint: int) -> None:
    with socket.create_connection(("127.0.0.1", endpoint)) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        started = time.monotonic()
        assert closed_by_server(slow, 10.0)
        assert time.monotonic() - started < 8.0
    assert "probe_value 7.0" in scrape(endpoint)
