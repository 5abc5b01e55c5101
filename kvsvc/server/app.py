"""Assembling and running the server: pools, servicers, health and metrics, served by
the two listeners of :mod:`kvsvc.server.transports` (gRPC, and frames where configured).

Health (``grpc.health.v1``): the overall service ``""`` is SERVING while the server runs;
``kvsvc.v1.KVCacheService`` is SERVING when every pool serves engine calls (READY or
DEGRADED); each pool also has its own entry, ``kvsvc.v1.KVCacheService/<pool>``
(see :func:`pool_health_name`). Shutdown sets everything NOT_SERVING first, then stops
the server with a grace period.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvsvc.ports import ListenError
from kvsvc.server.addresses import METRICS_LISTEN_FLAG, check_server_addresses
from kvsvc.server.config import ConfigFileError, ServerConfig, listen_addresses
from kvsvc.server.plugins import NO_EVENT_SINKS, EventSinkFactory, EventSinks, check_event_sinks
from kvsvc.server.pool import Pool, PoolState
from kvsvc.server.servicers import AdminServicer, KVCacheServicer, Pools, WorkerServicer
from kvsvc.server.transports.auth import load_credentials
from kvsvc.server.transports.frames_listener import (
    FrameLimits,
    FrameServer,
    bind_frames_addresses,
    unary_methods,
)
from kvsvc.server.transports.gate import CallGate, InflightLimits
from kvsvc.server.transports.grpc_listener import (
    bind_grpc_addresses,
    create_grpc_server,
    kvcache_method_handlers,
    recorded_handlers,
    register_services,
)
from kvsvc.tls import ServerTlsSource, TlsFileError
from kvsvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    kvcache_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

log = logging.getLogger("kvsvc.server")

KVCACHE_SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"].full_name
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def pool_health_name(pool: str) -> str:
    """The health-check service name of one pool (SERVING once it is READY)."""
    return f"{KVCACHE_SERVICE}/{pool}"


class KvsvcServer:
    """A running (or startable) kvsvc server. Use :func:`create_server`."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        metrics_registry: Any | None = None,
        restore: Sequence[str] = (),
        freeze_gc: bool = False,
        event_sinks: Mapping[str, EventSinkFactory] = NO_EVENT_SINKS,
    ) -> None:
        """Raises StateError (a ConfigFileError) when a pool's saved state, or a
        ``restore`` file, cannot be used: nothing is served then; ConfigError when the
        config asks for an event sink that ``event_sinks`` does not serve.

        ``event_sinks``: config setting -> the factory of the sink that serves it
        (:mod:`kvsvc.server.plugins`), attached when the config sets it.

        ``freeze_gc``: the first time each pool is READY, collect once and move every
        object then alive out of the collector's reach (:func:`gc.freeze`), for a process
        that is the server alone (``kvsvc serve``): see :func:`freeze_long_lived`.
        """
        from kvsvc.server.restore import lock_state_dir

        self.config = config
        self.credentials = load_credentials(config)  # ConfigError before anything starts
        check_event_sinks(config, event_sinks)
        self.pools = Pools(
            {
                p.name: Pool(
                    p,
                    event_capacity=config.event_buffer_batches,
                    event_max_events=config.event_buffer_events,
                    heartbeat_timeout_s=config.heartbeat_timeout_s,
                    on_state_change=self._on_pool_state_change,
                )
                for p in config.pools
            }
        )
        for p in config.pools:
            self.pools.by_name[p.name].events.configure(
                pool=p.name,
                max_bytes=config.event_buffer_bytes,
                max_subscribers=p.max_subscribers,
                max_lag_bytes=p.subscriber_max_lag_bytes,
                write_timeout_s=config.subscriber_write_timeout_s,
            )
        # One server per state directory: locked before anything in it is read, held
        # until stop() (or this process's end: a SIGKILL leaves no stale lock).
        self.state_lock = lock_state_dir(config)
        try:
            self._load(config, restore, metrics_registry, event_sinks)
        except BaseException:
            self._release_state_dir()
            raise
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._metrics_http: Any = None
        # The first TCP listener's port (0: none), and the unix:PATH listeners.
        self.port = 0
        self.unix_sockets: list[str] = []
        self.metrics_port = 0
        self._frames: FrameServer | None = None
        self.gate: CallGate | None = None
        # The framed transport's addresses as bound (a TCP port 0 resolved).
        self.frames_addresses: list[str] = []
        self._last_health: dict[str, int] = {}
        self._freeze_gc = freeze_gc
        self._frozen_pools: set[str] = set()

    def _load(
        self,
        config: ServerConfig,
        restore: Sequence[str],
        metrics_registry: Any | None,
        event_sinks: Mapping[str, EventSinkFactory],
    ) -> None:
        """The pools' saved states, the event sinks, metrics and TLS (the state directory
        is locked; the caller releases it when this raises)."""
        from kvsvc.server.metrics import ServerMetrics
        from kvsvc.server.restore import load_states

        # Saved states first: the event sinks below must not see their replay.
        self.restored = load_states(self.pools.by_name, config, restore)
        for line in self.restored:
            log.info("%s", line)
        self.event_sinks = EventSinks.attach(config, self.pools.by_name.values(), event_sinks)
        self.metrics = ServerMetrics(self.pools, registry=metrics_registry)
        # One certificate source for both listeners (gRPC and /metrics), re-read on change.
        self.tls: ServerTlsSource | None = None
        server_tls = config.server_tls()
        if server_tls is not None:
            try:
                self.tls = ServerTlsSource(server_tls)
            except TlsFileError as exc:  # the files changed since the config was checked
                raise ConfigFileError(str(exc)) from None

    def _release_state_dir(self) -> None:
        if self.state_lock is not None:
            self.state_lock.release()

    def _on_pool_state_change(self, pool: Pool) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._update_health()))
        self._tasks = [t for t in self._tasks if not t.done()]
        if (
            self._freeze_gc
            and pool.state is PoolState.READY
            and pool.name not in self._frozen_pools
        ):
            # Its block pool, index and plan were just built: they live as long as it.
            self._frozen_pools.add(pool.name)
            loop.call_soon(freeze_long_lived)

    async def _update_health(self) -> None:
        serving_states = (PoolState.READY, PoolState.DEGRADED)
        statuses = {
            pool_health_name(name): SERVING if pool.state in serving_states else NOT_SERVING
            for name, pool in self.pools.by_name.items()
        }
        statuses[KVCACHE_SERVICE] = (
            SERVING if all(s == SERVING for s in statuses.values()) else NOT_SERVING
        )
        for service, status in statuses.items():
            if self._last_health.get(service) != status:
                self._last_health[service] = status
                await self.health.set(service, status)

    async def start(self) -> None:
        """Start serving.

        Raises:
            ListenError: naming every address (gRPC, frames, /metrics, KV events) that
                cannot be bound, before anything starts.
        """
        # Every address is tried before anything starts: each port in use is one line
        # naming its flag (ListenError), not gRPC's traceback or a half-started server.
        try:
            check_server_addresses(self.config)
        except BaseException:
            self._release_state_dir()
            raise
        for pool in self.pools.by_name.values():
            pool.start_state()
        self.event_sinks.start()  # first: a port taken since the check stops the start
        try:
            await self._start_grpc()
        except BaseException:
            self.event_sinks.close()
            self._release_state_dir()
            raise
        if self.state_lock is not None:  # a server refused the directory names these
            self.state_lock.describe(self.listening_on)

    async def _start_grpc(self) -> None:
        observer = self.metrics.call_observer
        addresses = listen_addresses(self.config.listen, "listen")
        frames = (
            listen_addresses(self.config.frames_listen, "frames_listen")
            if self.config.frames_listen
            else []
        )
        server = create_grpc_server(self.config, self.credentials, observer)
        kvcache = KVCacheServicer(self.pools, observer, self.config.max_step_operations)
        admin = AdminServicer(self.pools, observer, time.monotonic)
        # Every handler is wrapped: a body that does not parse is INVALID_ARGUMENT, and
        # calls in flight are bounded per kind of caller (kvsvc.server.transports.gate).
        config = self.config
        self.gate = gate = CallGate(
            InflightLimits(
                max_inflight_calls=config.max_inflight_calls,
                max_inflight_request_bytes=config.max_inflight_request_bytes,
                max_inflight_agent_calls=config.max_inflight_agent_calls,
                max_inflight_streams=config.max_inflight_streams,
            ),
            observer,
        )
        services = (
            # WatchEvents: bytes serialized once for all subscribers.
            (KVCACHE_SERVICE, kvcache_method_handlers(kvcache)),
            (
                WORKER_SERVICE,
                recorded_handlers(
                    worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                    WorkerServicer(self.pools, observer),
                ),
            ),
            (
                ADMIN_SERVICE,
                recorded_handlers(admin_pb2_grpc.add_AdminServiceServicer_to_server, admin),
            ),
        )
        health_handlers = recorded_handlers(
            health_pb2_grpc.add_HealthServicer_to_server, self.health
        )
        register_services(server, gate, services, (HEALTH_SERVICE, health_handlers))
        self.port, self.unix_sockets = await bind_grpc_addresses(server, addresses, self.tls)
        await self._update_health()
        await server.start()
        self._server = server
        if frames:
            try:
                await self._start_frames(frames, kvcache, admin)
            except BaseException:
                await self.stop(0)
                raise
        if self.config.metrics_listen:
            try:
                self._metrics_http, self.metrics_port = self.metrics.serve_http(
                    self.config.metrics_listen, tls=self.tls
                )
            except OSError as exc:
                await server.stop(None)
                self._server = None
                raise ListenError(
                    self.config.metrics_listen, "/metrics", METRICS_LISTEN_FLAG, exc
                ) from None
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch_heartbeats()))
        # DEBUG: `kvsvc serve` prints its own start-up line (which tools wait for) on
        # stdout; at INFO this one showed up next to it, the same news twice.
        log.debug(
            "kvsvc serving on %s (%s; metrics %s); pools: %s",
            self.listening_on,
            "plaintext"
            if self.tls is None
            else ("mTLS: client certificates required" if self.tls.tls.mutual else "TLS"),
            self.metrics_port or "off",
            ", ".join(self.pools.by_name),
        )

    async def _start_frames(
        self, addresses: list[str], kvcache: KVCacheServicer, admin: AdminServicer
    ) -> None:
        """The framed transport's listeners: the same servicers' unary methods."""
        self._frames = FrameServer(
            [
                *unary_methods(kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"], kvcache),
                *unary_methods(admin_pb2.DESCRIPTOR.services_by_name["AdminService"], admin),
            ],
            self.credentials,
            self.metrics.call_observer,
            max_message_bytes=self.config.max_message_bytes,
            limits=FrameLimits(
                max_connections=self.config.frames_max_connections,
                max_pending=self.config.frames_max_pending_connections,
                hello_timeout_s=self.config.frames_hello_timeout_s,
                idle_timeout_s=self.config.frames_idle_timeout_s,
                frame_timeout_s=self.config.frames_frame_timeout_s,
            ),
            ssl_context=self.tls.ssl_context if self.tls is not None else None,
        )
        self.frames_addresses = await bind_frames_addresses(self._frames, addresses)

    @property
    def listening_on(self) -> str:
        """Where the gRPC listeners are, as bound ("port 50051, unix:/run/kvsvc.sock")."""
        return ", ".join([*([f"port {self.port}"] if self.port else []), *self.unix_sockets])

    @property
    def frames_port(self) -> int:
        """The first framed TCP listener's port (0: none)."""
        return self._frames.port if self._frames is not None else 0

    async def _watch_heartbeats(self) -> None:
        interval = min(1.0, self.config.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for pool in self.pools.by_name.values():
                pool.check_heartbeats()

    async def stop(self, grace: float = 5.0) -> None:
        """Graceful stop: health NOT_SERVING first, then drain calls for ``grace`` s."""
        await self.health.enter_graceful_shutdown()
        for pool in self.pools.by_name.values():
            pool.stopping = True  # the streams it ends next are no lost ranks
        for task in self._tasks:
            task.cancel()
        # Streams never end by themselves: end them now (UNAVAILABLE, "shutting down")
        # rather than wait out the grace period for nothing.
        self.pools.streams.close()
        if self._frames is not None:
            await self._frames.stop(grace)
            self._frames = None
        if self._server is not None:
            await self._server.stop(grace)
        # After the last call: each persisted pool ends with a snapshot (no replay next time).
        for pool in self.pools.by_name.values():
            await pool.close_state()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()  # release the port now, not at collection
            self._metrics_http = None
        if self.event_sinks:
            # After the gRPC stop: the last calls' events are still published.
            await asyncio.get_running_loop().run_in_executor(None, self.event_sinks.close)
        self._release_state_dir()  # after the final snapshots: the next server may start

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


def freeze_long_lived() -> None:
    """Collect once, then leave every object alive now out of later collections.

    A planned pool holds hundreds of thousands of objects (blocks, hashes, the prefix
    index) for its whole life; each full collection walked them all, a pause of tens of
    milliseconds in the middle of some engine call (py-spy on a loaded server: 45% of the
    samples holding the GIL were in the collector). Frozen, they are never walked;
    what is made later is collected as before.
    """
    gc.collect()
    gc.freeze()


async def create_server(config: ServerConfig, **kwargs: Any) -> tuple[KvsvcServer, int]:
    """Build and start a server; returns it and the gRPC port it bound (port 0 -> free;
    0 when it listens on Unix sockets only: ``server.unix_sockets``)."""
    server = KvsvcServer(config, **kwargs)
    await server.start()
    return server, server.port
