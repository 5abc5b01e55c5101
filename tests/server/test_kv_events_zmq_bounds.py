"""The vLLM-format KV event publisher (``kvsvc serve --kv-events-zmq``): what a subscriber
that stops reading may hold, and a loopback TCP endpoint (issue 32, items 14 and 15d).

- ZMQ holds what a subscriber has not taken up to ``kv_events_hwm`` messages, whatever
  their size: 4 stalled subscribers took a server 150 MB up. The publisher now tracks
  one payload in every ``kv_events_max_held_bytes / 64`` bytes, which tells the bytes the
  slowest subscriber holds; past the bound it resets its PUB socket, which frees them: a
  subscriber that reads reconnects, sees a sequence gap and replays it.
- vLLM's rule connects to ``tcp://HOST:PORT``, so a publisher could not bind loopback only;
  ``--kv-events-bind`` binds it.

Real ZMQ sockets over loopback TCP, a real ``kvsvc serve``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kvsvc.core import events as kv  # noqa: E402
from kvsvc.demo.processes import spawn  # noqa: E402
from kvsvc.server.config import ConfigError, PoolConfig, ServerConfig  # noqa: E402
from kvsvc.server.kv_events_targets import KVEventsTarget, kv_events_targets  # noqa: E402

BUDGET = 2 << 20
POOL = PoolConfig(name="p", max_model_len=256)
_EVENTS_LINE = re.compile(r"kv events of pool p on (tcp://\S+?)(,|$)")


def batch(seq: int) -> kv.KVEventBatch:
    """About 40 KB as vLLM's msgpack: 8,192 token ids of one stored run."""
    hashes = [bytes([seq % 256, i]) * 8 for i in range(16)]
    tokens = [70_000 + i for i in range(8192)]
    stored = kv.BlockStored(hashes, None, tokens, 512, None, "GPU", 0, "full_attention")
    return kv.KVEventBatch(seq=seq, timestamp=0.0, events=[stored])


@pytest.fixture()
def ctx() -> Iterator[Any]:
    context = zmq.Context()
    yield context
    context.term()


def wait_until(condition: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Reader:
    """A subscriber that reads everything, noting each sequence number it gets."""

    def __init__(self, ctx: Any, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                self.seen.append(int.from_bytes(self.sock.recv_multipart()[1], "big"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def test_a_subscriber_that_stops_reading_holds_at_most_the_byte_bound(ctx: Any) -> None:
    """Regression: a subscriber that stopped reading was sent everything up to 100,000
    messages (the count mark), whatever their size. What it holds is now counted in
    bytes; past the bound the socket is reset (the stalled one's queue freed), and a
    subscriber that reads goes on after it."""
    from kvsvc.integrations.vllm.events import ZmqEventPublisher

    target = KVEventsTarget("p", "tcp://127.0.0.1:0", None, "", bind=True)
    publisher = ZmqEventPublisher(target, max_held_bytes=BUDGET, context=ctx)
    publisher.start()
    stalled = ctx.socket(zmq.SUB)  # subscribes, then never reads
    stalled.setsockopt(zmq.RCVHWM, 4)
    stalled.setsockopt(zmq.RCVBUF, 1 << 16)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(publisher.endpoint)
    reader = Reader(ctx, publisher.endpoint)
    try:
        time.sleep(0.3)  # both subscriptions reach the publisher (ZMQ's slow joiner)
        most = 0
        for seq in range(1, 601):  # ~24 MB of 40 KB batches: far past the bound
            publisher.submit(batch(seq))
            if seq % 10 == 0:
                wait_until(lambda s=seq: publisher.num_published_batches >= s, "publishing")
                most = max(most, publisher.held_bytes)
        resets = publisher.num_resets
        assert resets >= 1 and 0 < most <= BUDGET
        # The reader reconnects after a reset (what was published meanwhile is a gap a
        # vLLM consumer replays): small batches reach it again, and hold nothing up.
        seq = 600
        while not reader.seen or reader.seen[-1] < 600:
            seq += 1
            assert seq < 2000, f"the reader got nothing after the resets: {reader.seen[-5:]}"
            publisher.submit(kv.KVEventBatch(seq=seq, timestamp=0.0, events=[]))
            time.sleep(0.02)
        assert publisher.num_resets == resets
    finally:
        reader.close()
        stalled.close(0)
        publisher.close()


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
