"""Every address a server will listen on, tried together before anything starts.

A server listens on up to four kinds of address: gRPC (``listen``), the framed transport
(``frames_listen``), ``/metrics`` and, with vLLM-format KV events, each pool's ZMQ PUB and
replay sockets. A start that tried them one at a time named one taken port per attempt
(fix ``--listen``, start again, fail on 9400); :func:`check_server_addresses` names every
one that cannot be bound in one error, a line each with the flag that moves it.
"""

from __future__ import annotations

from kvsvc.ports import Listener, check_listeners, is_unix_address
from kvsvc.server.config import ServerConfig, listen_addresses, split_host_port
from kvsvc.server.kv_events_targets import is_bind_endpoint, kv_events_targets
from kvsvc.server.transports.frames_listener import FRAMES_LISTEN_FLAG
from kvsvc.server.transports.grpc_listener import LISTEN_FLAG

# What a ListenError tells the user to change (``kvsvc serve``'s flag, the config key); the
# listeners' own: grpc_listener.LISTEN_FLAG, frames_listener.FRAMES_LISTEN_FLAG.
METRICS_LISTEN_FLAG = "--metrics-listen (config key metrics_listen)"
KV_EVENTS_FLAGS = {
    "kv_events_zmq": "--kv-events-zmq (config key kv_events_zmq)",
    "kv_events_replay": "--kv-events-replay (config key kv_events_replay)",
}


def _address_listeners(setting: str, key: str, what: str, flag: str) -> list[Listener]:
    listeners = []
    for address in listen_addresses(setting, key):
        if is_unix_address(address):
            listeners.append(Listener(address, what, flag))
        else:
            host, port = split_host_port(address, key)
            listeners.append(Listener(address, what, flag, host, port))
    return listeners


def _zmq_listener(endpoint: str, what: str, key: str) -> Listener | None:
    """A bound ZMQ ``tcp://`` endpoint as a listener (None: connected, or ipc/inproc,
    which ZMQ reports itself)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    return Listener(
        endpoint, what, KV_EVENTS_FLAGS[key], "0.0.0.0" if host == "*" else host, int(port)
    )


def server_listeners(config: ServerConfig) -> list[Listener]:
    """What ``config`` listens on, in the order the server binds it.

    Raises:
        ConfigError: an address of the wrong form.
    """
    listeners = _address_listeners(config.listen, "listen", "gRPC", LISTEN_FLAG)
    if config.frames_listen:
        listeners += _address_listeners(
            config.frames_listen, "frames_listen", "frames", FRAMES_LISTEN_FLAG
        )
    if config.metrics_listen:
        host, port = split_host_port(config.metrics_listen, "metrics_listen")
        listeners.append(
            Listener(config.metrics_listen, "/metrics", METRICS_LISTEN_FLAG, host, port)
        )
    for target in kv_events_targets(config):
        for endpoint, what, key, binds in (
            (target.endpoint, "KV events", "kv_events_zmq", is_bind_endpoint(target.endpoint)),
            (target.replay_endpoint, "KV event replay", "kv_events_replay", True),
        ):
            if endpoint is not None and binds:
                listener = _zmq_listener(endpoint, f"{what} of pool {target.pool}", key)
                if listener is not None:
                    listeners.append(listener)
    return listeners


def check_server_addresses(config: ServerConfig) -> None:
    """Try every address ``config`` listens on.

    Raises:
        ListenError: one line per address that cannot be bound now.
        ConfigError: an address of the wrong form.
    """
    check_listeners(server_listeners(config))
