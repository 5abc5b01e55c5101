"""The consumer side of vLLM's ZMQ KV event stream, as vLLM's consumers speak it: a SUB
socket that is connected before the first event, and the replay socket's DEALER dialogue.
Shared by the tests that read kvsvc's stream and stock vLLM's."""

from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

# vLLM's end-of-replay sequence frame.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def loopback(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def subscribe(ctx: Any, endpoint: str, topic: str = "") -> Any:
    """A SUB socket on ``endpoint`` whose subscription has reached the publisher (ZMQ
    drops what a PUB sends before that)."""
    sub = ctx.socket(zmq.SUB)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(loopback(endpoint))
    assert monitor.poll(30_000), f"SUB did not connect to {endpoint}"
    assert recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    sub.disable_monitor()
    monitor.close(linger=0)
    time.sleep(0.2)  # the subscription travels after the handshake
    return sub


def replay(
    ctx: Any, endpoint: str, start: int, timeout: float = 5.0
) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay socket for everything from ``start``: (topic, seq, payload) each.

    A DEALER speaks to vLLM's ROUTER: ``[b"", start]`` out, ``[b"", topic, seq, payload]``
    per batch back, then the end marker ``[b"", b"", -1, b""]``.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.connect(loopback(endpoint))
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(int(timeout * 1000)), f"no end-of-replay marker within {timeout} s"
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", frames
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
