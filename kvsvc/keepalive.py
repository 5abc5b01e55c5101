"""HTTP/2 keepalive: what kvsvc's clients send and what its server accepts, in one place.

A client pings its server every ``keepalive_time`` while it has a call open (a
``WatchEvents`` or ``WatchPlan`` stream that may stay quiet for hours), so a peer that
vanished is noticed within ``keepalive_time`` + :data:`CLIENT_KEEPALIVE_TIMEOUT_S`. gRPC's
server, by default, takes a ping more often than every 5 minutes on a quiet connection as
abuse: after two such strikes it ends the connection with GOAWAY ``too_many_pings``. The
two defaults disagreed: a quiet stream of ``kvsvc ctl events`` or ``kvsvc indexer`` was
cut every few minutes. Here the server accepts pings as often as every
:data:`SERVER_MIN_PING_INTERVAL_S` (a third of the clients' interval, room for timer
jitter), and the clients keep pinging a quiet stream (gRPC's client stops after two pings
without data by default, leaving a dead peer unnoticed).

A client configured to ping more often than the server's ``keepalive_min_ping_interval_s``
is cut as before: keep ``ClientOptions.keepalive_time`` at or above it.
"""

from __future__ import annotations

CLIENT_KEEPALIVE_TIME_S = 30.0
CLIENT_KEEPALIVE_TIMEOUT_S = 20.0
SERVER_MIN_PING_INTERVAL_S = CLIENT_KEEPALIVE_TIME_S / 3
# Pings before the next allowed time that the server forgives before GOAWAY (gRPC's).
SERVER_MAX_PING_STRIKES = 2


def client_options(
    keepalive_time_s: float = CLIENT_KEEPALIVE_TIME_S,
) -> tuple[tuple[str, int], ...]:
    """gRPC channel options of a kvsvc client: ping every ``keepalive_time_s`` while a call
    is open, however long it stays quiet."""
    return (
        ("grpc.keepalive_time_ms", _ms(keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(CLIENT_KEEPALIVE_TIMEOUT_S)),
        ("grpc.http2.max_pings_without_data", 0),
    )


def server_options(
    min_ping_interval_s: float = SERVER_MIN_PING_INTERVAL_S,
) -> tuple[tuple[str, int], ...]:
    """gRPC server options: accept a client's pings every ``min_ping_interval_s``, on a
    quiet connection too."""
    return (
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", SERVER_MAX_PING_STRIKES),
        ("grpc.keepalive_permit_without_calls", 1),
    )


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
