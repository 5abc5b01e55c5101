"""The agent's Prometheus series exist from the start and are served on /metrics."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("torch")  # kvsvc.worker (the package) imports torch

from prometheus_client import generate_latest

from kvsvc.errors import InvalidArgument
from kvsvc.worker.metrics import AgentMetrics, parse_listen, serve_metrics

pytestmark = pytest.mark.torch

KNOWN_AT_ZERO = [
    "kvsvc_agent_tensor_bytes",
    "kvsvc_agent_device_memory_free_bytes",
    "kvsvc_agent_device_memory_total_bytes",
    "kvsvc_agent_kv_cache_offered_bytes",
    "kvsvc_agent_num_blocks",
    "kvsvc_agent_ready",
    "kvsvc_agent_heartbeats_total",
    "kvsvc_agent_reconnects_total",
    "kvsvc_agent_heartbeat_failures_total",
]


def test_every_series_is_exported_at_zero_before_anything_happens() -> None:
    metrics = AgentMetrics("p", 1, "cpu")
    text = generate_latest(metrics.registry).decode()
    assert 'kvsvc_agent_info{device="cpu",pool="p",rank="1"} 1.0' in text
    for name in KNOWN_AT_ZERO:
        assert f'{name}{{pool="p",rank="1"}} 0.0' in text, name


def test_two_agents_in_one_process_keep_separate_registries() -> None:
    a, b = AgentMetrics("p", 0, "cpu"), AgentMetrics("p", 1, "cpu")
    a.heartbeats.inc()
    assert (
        a.registry.get_sample_value("kvsvc_agent_heartbeats_total", {"pool": "p", "rank": "0"}) == 1
    )
    assert (
        b.registry.get_sample_value("kvsvc_agent_heartbeats_total", {"pool": "p", "rank": "1"}) == 0
    )


def test_metrics_are_served_over_http() -> None:
    metrics = AgentMetrics("p", 0, "cpu")
    metrics.num_blocks.set(42)
    server = serve_metrics("127.0.0.1:0", metrics.registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            body = r.read().decode()
    finally:
        server.close()
    assert 'kvsvc_agent_num_blocks{pool="p",rank="0"} 42.0' in body


@pytest.mark.parametrize("listen", ["9100", "host:", "host:port", "h:70000"])
def test_bad_listen_addresses_name_the_flag(listen: str) -> None:
    with pytest.raises(InvalidArgument, match=r"metrics_listen: expected HOST:PORT"):
        parse_listen(listen)


def test_listen_addresses_parse_ipv4_ipv6_and_empty_hosts() -> None:
    assert parse_listen("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert parse_listen("[::1]:9100") == ("::1", 9100)
    assert parse_listen(":9100") == ("0.0.0.0", 9100)
