"""Where each pool publishes its vLLM-format KV events: the endpoints the ``kv_events_*``
keys of a :class:`~kvsvc.server.config.ServerConfig` give, one PUB (and replay) socket per
pool as vLLM gives one per data-parallel rank, checked for collisions before anything binds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsvc.server.config_errors import ConfigError

KV_EVENTS_SCHEMES = ("tcp://", "ipc://", "inproc://")
# Replaced by the pool's name in kv_events_topic (and nowhere else).
POOL_PLACEHOLDER = "{pool}"


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class EventsSettings(Protocol):
    """What :func:`kv_events_targets` reads of a
    :class:`~kvsvc.server.config.ServerConfig` (whose own checks call it: a protocol
    rather than an import of the config)."""

    @property
    def pools(self) -> Sequence[_Named]: ...
    @property
    def kv_events_zmq(self) -> str | None: ...
    @property
    def kv_events_replay(self) -> str | None: ...
    @property
    def kv_events_topic(self) -> str: ...
    @property
    def kv_events_bind(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class KVEventsTarget:
    """Where one pool publishes its vLLM-format KV events.

    Attributes:
        pool: the pool's name.
        endpoint: its PUB endpoint (bound or connected: :attr:`binds`).
        replay_endpoint: its ROUTER endpoint for replay requests, if any (bound).
        topic: the topic frame of its messages.
        bind: True: the PUB binds ``endpoint`` whatever it names (``kv_events_bind``);
            None: vLLM's rule (:func:`is_bind_endpoint`). See :attr:`binds`.
    """

    pool: str
    endpoint: str
    replay_endpoint: str | None
    topic: str
    bind: bool | None = None

    @property
    def binds(self) -> bool:
        """Whether the PUB binds ``endpoint`` (else it connects to it)."""
        return self.bind if self.bind is not None else is_bind_endpoint(self.endpoint)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or ipc/inproc endpoint, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _tcp_port(endpoint: str, what: str) -> int:
    _, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit() and int(port) <= 65535:
        return int(port)
    raise ConfigError(f"{what}: expected tcp://HOST:PORT, got {endpoint!r}")


def _check_endpoint(endpoint: str, what: str) -> None:
    if not endpoint.startswith(KV_EVENTS_SCHEMES) or endpoint in KV_EVENTS_SCHEMES:
        raise ConfigError(
            f"{what}: expected a ZMQ endpoint ({', '.join(s + '...' for s in KV_EVENTS_SCHEMES)})"
            f", got {endpoint!r}"
        )
    if endpoint.startswith("tcp://"):
        _tcp_port(endpoint, what)


def offset_endpoint(endpoint: str, index: int, pool: str) -> str:
    """The endpoint of the ``index``-th pool: what vLLM does for data-parallel rank ``index``.

    TCP ports go up by ``index`` (port 0 stays 0: the OS picks one per socket); other
    transports get ``_<pool>`` appended. The first pool keeps the endpoint as given.
    """
    if index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        port = _tcp_port(endpoint, "kv_events endpoint")
        if port == 0:
            return endpoint
        if port + index > 65535:
            raise ConfigError(
                f"kv events endpoint {endpoint!r}: pool {pool!r} (number {index + 1}) would "
                f"use port {port + index}, beyond 65535"
            )
        base = endpoint[: endpoint.rfind(":")]
        return f"{base}:{port + index}"
    return f"{endpoint}_{pool}"


def kv_events_targets(config: EventsSettings) -> list[KVEventsTarget]:
    """Each pool's vLLM-format event endpoints, in config order (empty when off).

    Every pool gets its own PUB socket, replay socket, sequence numbers and replay buffer,
    as each data-parallel rank of vLLM does: a consumer written for vLLM follows one
    socket's sequence and replays from that socket, so pools sharing a socket would look
    to it like one engine with gaps. Pool ``i`` uses the configured TCP ports + ``i``.

    Raises:
        ConfigError: a malformed endpoint, a port beyond 65535, a connected endpoint with
            port 0, or two sockets that would bind the same port or path.
    """
    if config.kv_events_zmq is None:
        return []
    _check_endpoint(config.kv_events_zmq, "kv_events_zmq")
    if config.kv_events_replay is not None:
        _check_endpoint(config.kv_events_replay, "kv_events_replay")
    connects = not (config.kv_events_bind or is_bind_endpoint(config.kv_events_zmq))
    if connects and _tcp_port(config.kv_events_zmq, "kv_events_zmq") == 0:
        raise ConfigError(
            f"kv_events_zmq {config.kv_events_zmq!r} is connected to (no '*' in it), so it "
            "needs a real port; use tcp://*:PORT to bind, or kv_events_bind "
            "(--kv-events-bind) to bind that host's address"
        )
    targets = []
    bound: dict[str, str] = {}
    for index, pool in enumerate(config.pools):
        endpoint = offset_endpoint(config.kv_events_zmq, index, pool.name)
        replay = (
            offset_endpoint(config.kv_events_replay, index, pool.name)
            if config.kv_events_replay is not None
            else None
        )
        target = KVEventsTarget(
            pool=pool.name,
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=config.kv_events_topic.replace(POOL_PLACEHOLDER, pool.name),
            bind=True if config.kv_events_bind else None,
        )
        for what, address, binds in (
            ("kv_events_zmq", endpoint, target.binds),
            ("kv_events_replay", replay, True),
        ):
            if address is None or not binds:
                continue
            if address.startswith("tcp://"):
                port = _tcp_port(address, what)
                if port == 0:
                    continue  # the OS picks a free port for each socket
                key = f"tcp:{port}"
            else:
                key = address
            if key in bound:
                hint = (
                    f"; pool i uses port + i, so leave {len(config.pools)} ports between "
                    "kv_events_zmq and kv_events_replay"
                    if key.startswith("tcp:")
                    else ""
                )
                raise ConfigError(
                    f"{what} of pool {pool.name!r} ({address}) collides with {bound[key]}{hint}"
                )
            bound[key] = f"{what} of pool {pool.name!r} ({address})"
        targets.append(target)
    return targets
