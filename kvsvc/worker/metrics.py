"""Prometheus metrics of a worker agent, on an explicit registry.

Every series exists (at 0) from construction, so a scrape before registration already shows
the agent and dashboards need no ``absent()`` guards::

    kvsvc_agent_info{pool,rank,device}                 1
    kvsvc_agent_tensor_bytes{pool,rank}                bytes of KV tensors held
    kvsvc_agent_device_memory_free_bytes{pool,rank}    free device (host) memory, per heartbeat
    kvsvc_agent_device_memory_total_bytes{pool,rank}
    kvsvc_agent_kv_cache_offered_bytes{pool,rank}      the profiled budget
    kvsvc_agent_num_blocks{pool,rank}                  blocks per layer of the plan
    kvsvc_agent_ready{pool,rank}                       1 once the server accepted the allocation
    kvsvc_agent_heartbeats_total{pool,rank}            accepted heartbeats
    kvsvc_agent_heartbeat_failures_total{pool,rank}
    kvsvc_agent_reconnects_total{pool,rank}            sessions re-established after a loss
"""

from __future__ import annotations

from dataclasses import dataclass
from threading import Thread
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvsvc.errors import InvalidArgument
from kvsvc.metrics_http import serve_metrics_http
from kvsvc.tls import ServerTls, ServerTlsSource


class AgentMetrics:
    """The agent's series for one ``(pool, rank)``; thread-safe (prometheus_client is)."""

    def __init__(
        self, pool: str, rank: int, device: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("pool", "rank")
        values = (pool, str(rank))

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        Gauge(
            "kvsvc_agent_info",
            "The worker agent: pool, rank and device.",
            ("pool", "rank", "device"),
            registry=self.registry,
        ).labels(pool, str(rank), device).set(1)
        self.tensor_bytes = gauge("kvsvc_agent_tensor_bytes", "Bytes of KV cache tensors held.")
        self.memory_free = gauge(
            "kvsvc_agent_device_memory_free_bytes", "Free device (or host) memory."
        )
        self.memory_total = gauge(
            "kvsvc_agent_device_memory_total_bytes", "Total device (or host) memory."
        )
        self.offered = gauge(
            "kvsvc_agent_kv_cache_offered_bytes", "Bytes the agent offered the KV cache."
        )
        self.num_blocks = gauge("kvsvc_agent_num_blocks", "Blocks per layer of the plan.")
        self.ready = gauge(
            "kvsvc_agent_ready", "1 once the server accepted this rank's allocation, else 0."
        )
        self.heartbeats = counter("kvsvc_agent_heartbeats", "Heartbeats the server accepted.")
        self.heartbeat_failures = counter(
            "kvsvc_agent_heartbeat_failures", "Heartbeats that failed."
        )
        self.reconnects = counter(
            "kvsvc_agent_reconnects",
            "Sessions re-established (resumed or registered anew) after a loss.",
        )


def parse_listen(listen: str, *, field: str = "metrics_listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as ``(host, port)``.

    Raises:
        InvalidArgument: naming ``field``.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(field, f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


@dataclass(slots=True)
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it."""

    server: Any
    thread: Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(
    listen: str, registry: CollectorRegistry, tls: ServerTls | None = None
) -> MetricsServer:
    """Serve ``registry`` as Prometheus text on ``http(s)://HOST:PORT/metrics`` (port 0: any).

    Args:
        listen: ``HOST:PORT``.
        registry: the agent's series.
        tls: serve HTTPS with this certificate (re-read when it changes), requiring client
            certificates when it has a client CA; None for plain HTTP.

    Raises:
        InvalidArgument: a malformed ``listen``.
        TlsFileError: a TLS file cannot be used.
        OSError: the port cannot be bound.
    """
    host, port = parse_listen(listen)
    source = ServerTlsSource(tls) if tls is not None else None
    server, thread = serve_metrics_http(host, port, registry, source)
    return MetricsServer(server, thread)
