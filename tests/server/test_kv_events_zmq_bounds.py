"""The vLLM-format KV event publisher (``kvsvc serve --kv-events-zmq``) on a loopback TCP
endpoint (issue 32, item 15d): vLLM's rule connects to ``tcp://HOST:PORT``, so a publisher
could not bind loopback only; ``--kv-events-bind`` binds it. A real ``kvsvc serve``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvsvc.demo.processes import spawn  # noqa: E402
from kvsvc.server.config import (  # noqa: E402
    ConfigError,
    PoolConfig,
    ServerConfig,
    kv_events_targets,
)

POOL = PoolConfig(name="p", max_model_len=256)
_EVENTS_LINE = re.compile(r"kv events of pool p on (tcp://\S+?)(,|$)")


def wait_until(condition: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_loopback_endpoint_is_bound_with_kv_events_bind() -> None:
    """vLLM's rule connects to tcp://127.0.0.1:PORT (and port 0 cannot be connected to);
    --kv-events-bind binds it, on loopback only, and a subscriber reads from it."""
    with pytest.raises(ConfigError, match="--kv-events-bind"):
        ServerConfig(pools=(POOL,), kv_events_zmq="tcp://127.0.0.1:0", metrics_listen=None)
    bound = ServerConfig(
        pools=(POOL,), kv_events_zmq="tcp://127.0.0.1:0", kv_events_bind=True, metrics_listen=None
    )
    assert [t.binds for t in kv_events_targets(bound)] == [True]
    serve = spawn(
        "serve",
        ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p",
         "--max-model-len", "256", "--kv-events-zmq", "tcp://127.0.0.1:0", "--kv-events-bind",
         "--log-level", "INFO"],
    )  # fmt: skip
    try:
        wait_until(lambda: any(_EVENTS_LINE.search(line) for line in serve.lines), "serve")
        match = next(m for m in map(_EVENTS_LINE.search, serve.lines) if m)
        endpoint = match.group(1)
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        context = zmq.Context()
        probe = context.socket(zmq.SUB)
        monitor = probe.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            probe.connect(endpoint)  # something listens there: the publisher
            assert monitor.poll(10_000), "nothing accepted the connection"
        finally:
            probe.disable_monitor()
            monitor.close(0)
            probe.close(0)
            context.term()
    finally:
        assert serve.stop() == 0, serve.output()
