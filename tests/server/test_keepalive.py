"""The clients' keepalive pings and the server's ping policy agree: a quiet stream stays
open for longer than the policy's window (gRPC's server ends a connection with GOAWAY
``too_many_pings`` after two pings it takes as too frequent).

The default run scales both intervals down 30x through their settings (the client's
``keepalive_time``, the server's ``keepalive_min_ping_interval_s``); ``KVSVC_SLOW=1``
holds a stream quiet for 200 s with the defaults, past the 2-3 minutes it used to last.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
from kvsvc_client import ClientOptions, KVCacheClient, RequestStart

from kvsvc.keepalive import CLIENT_KEEPALIVE_TIME_S, SERVER_MIN_PING_INTERVAL_S
from kvsvc.server.config import PoolConfig, ServerConfig
from tests.server.harness import bring_up, running_server

SLOW = bool(os.environ.get("KVSVC_SLOW"))
SCALE = 1.0 if SLOW else 1 / 30
# Quiet for longer than three of the client's pings: the policy's window.
HOLD_S = 200.0 if SLOW else 8.0


def test_the_default_intervals_agree() -> None:
    """The server takes pings at least twice as often as the clients send them."""
    assert ServerConfig(pools=(PoolConfig(name="p"),)).keepalive_min_ping_interval_s == (
        SERVER_MIN_PING_INTERVAL_S
    )
    assert ClientOptions().keepalive_time == CLIENT_KEEPALIVE_TIME_S
    assert SERVER_MIN_PING_INTERVAL_S * 2 <= CLIENT_KEEPALIVE_TIME_S


@pytest.mark.slow
def test_a_quiet_stream_outlives_the_ping_policy() -> None:
    pool = PoolConfig(name="p", max_model_len=256)
    with running_server(
        pool, keepalive_min_ping_interval_s=SERVER_MIN_PING_INTERVAL_S * SCALE
    ) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=64 * 32 * 1024)
        options = ClientOptions(retries=0, keepalive_time=CLIENT_KEEPALIVE_TIME_S * SCALE)
        received: list[Any] = []
        try:
            with KVCacheClient(server.address, pool="p", options=options) as kv:
                stream = kv.watch_events(reconnect=False, caught_up=True)
                assert next(stream).caught_up

                def follow() -> None:
                    try:
                        received.append(next(stream))
                    except Exception as exc:  # what the test reports
                        received.append(exc)

                follower = threading.Thread(target=follow, daemon=True)
                follower.start()
                time.sleep(HOLD_S)  # quiet: only the client's pings cross the connection
                assert not received, f"the quiet stream ended: {received}"
                assert kv.allocate("r", list(range(32)), 32, start=RequestStart()).ok
                follower.join(30)
                assert received and not isinstance(received[0], Exception), received
                assert received[0].sequence >= 1
                kv.free("r")
        finally:
            for rank in ranks:
                rank.close()
