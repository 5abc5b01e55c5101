"""The gRPC listener: the ``grpc.aio`` server, its options and auth interceptor, kvsvc's
services registered behind the gate, and the addresses it binds.

:func:`create_grpc_server` makes the server with kvsvc's message bound and keepalive
policy and, when the server has tokens, :class:`AuthInterceptor`, which decides every call
by :mod:`kvsvc.server.transports.auth` (the framed listener decides by the same rule).
:func:`register_services` registers the services, each handler wrapped by the gate
(:mod:`kvsvc.server.transports.gate`: malformed bodies, calls in flight), with health and
reflection; :func:`bind_grpc_addresses` binds ``listen``'s ports and Unix sockets.
:mod:`kvsvc.server.app` composes the servicers and calls these.

The generated ``add_*Servicer_to_server`` functions register a servicer's handlers
directly; here they are recorded first (:func:`recorded_handlers`), so the server can wrap
each one before registering them (:func:`add_service`).

KVCacheService's WatchEvents is also replaced by one that sends pre-serialized bytes.
Every subscriber of a pool gets the same event batches; the generated registration
serializes each message once per stream (``WatchEventsResponse.SerializeToString``), so a
batch of 256 events cost ~40 us per subscriber before gRPC even saw it. Here the
WatchEvents handler writes the bytes :class:`~kvsvc.server.events.EventLog` serialized
once, and its response serializer passes them through: the wire format is exactly the
generated one (the same message, serialized by protobuf), only the work is shared.
"""

from __future__ import annotations

import resource
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc

from kvsvc.keepalive import server_options as server_keepalive_options
from kvsvc.ports import ListenError, is_unix_address, private_umask, set_unix_socket_mode
from kvsvc.server.config import ServerConfig, join_host_port, split_host_port
from kvsvc.server.errors import CallObserver
from kvsvc.server.namespace import current_engine, current_pools
from kvsvc.server.seclog import RateLimitedLog
from kvsvc.server.transports.auth import (
    Credential,
    Credentials,
    Refusal,
    Role,
    authorize,
    report_refusal,
    roles_for_method,
)
from kvsvc.server.transports.codecs import KVCACHE_SERVICE, request_parser
from kvsvc.server.transports.gate import CallGate, current_caller
from kvsvc.server.transports.reflection import reflection_services
from kvsvc.tls import ServerTlsSource
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc

# What a ListenError tells the user to change (``kvsvc serve``'s flag, the config key).
LISTEN_FLAG = "--listen (config key listen)"

Handlers = dict[str, grpc.RpcMethodHandler]


# grpc_max_connections when not set: this many, or half the open-file limit if lower.
DEFAULT_GRPC_MAX_CONNECTIONS = 1024


def grpc_max_connections(config: ServerConfig) -> int:
    """The gRPC listener's connection cap: ``grpc_max_connections``, else 1024 or half the
    process's open-file limit (RLIMIT_NOFILE), whichever is lower. Past the descriptor
    limit accept() fails and gRPC retries it in a loop, so a crowd of bare connections
    made every new one, an engine's included, wait for ever; under the cap the extra ones
    are closed at once and the server keeps descriptors for its state and its other
    listeners."""
    if config.grpc_max_connections is not None:
        return config.grpc_max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_GRPC_MAX_CONNECTIONS
    return max(16, min(DEFAULT_GRPC_MAX_CONNECTIONS, soft // 2))


def create_grpc_server(
    config: ServerConfig, credentials: Credentials, observer: CallObserver
) -> grpc.aio.Server:
    """The gRPC server of ``config``: its message bound and keepalive policy, who holds a
    connection and for how long, and auth as one interceptor over every kvsvc method (none
    when no token is configured).

    Connections (what the framed listener bounds with its own settings): at most
    :func:`grpc_max_connections`, each given ``grpc_handshake_timeout_s`` to finish its
    handshake (a bare TCP connection that says nothing goes then, instead of after
    gRPC's 120 s) and closed after ``grpc_idle_timeout_s`` without a call in progress.
    gRPC does not tell a connection's credential before its first call, so the idle bound
    is for every connection: a client reconnects on its next call.
    """
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", grpc_max_connections(config)),
        ("grpc.server_handshake_timeout_ms", _ms(config.grpc_handshake_timeout_s)),
        # No BDP probing: a request whose message the server has not asked for (the gate
        # reads one only once the request budget allows) holds one HTTP/2 stream window,
        # 64 KiB; with it the window grew to ~16 MiB a stream (16 unread 60 MiB calls on
        # one connection: +258 MB, +2 MB without). gRPC widens a stream's window to
        # the whole message once it is read, so large requests are not slowed.
        ("grpc.http2.bdp_probe", 0),
        # The clients' keepalive pings are welcome (kvsvc.keepalive).
        *server_keepalive_options(config.keepalive_min_ping_interval_s),
    ]
    if config.grpc_idle_timeout_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(config.grpc_idle_timeout_s)))
    interceptors = [AuthInterceptor(credentials, observer)] if credentials.enabled else []
    return grpc.aio.server(options=options, interceptors=interceptors)


def register_services(
    server: grpc.aio.Server,
    gate: CallGate,
    services: Sequence[tuple[str, Handlers]],
    health: tuple[str, Handlers],
) -> None:
    """Register ``services`` (name, handlers), every handler wrapped by ``gate``: its
    request read under the request budget, a body that does not parse INVALID_ARGUMENT,
    and calls in flight bounded per kind of caller; the ``health`` service and reflection
    (``grpc.reflection.v1`` and ``v1alpha``, describing them all) are not counted in flight
    (probes), but their requests are read under the same budget."""
    for service, handlers in services:
        add_service(server, service, gate.guard(service, handlers))
    health_service, health_handlers = health
    add_service(server, health_service, gate.guard(health_service, health_handlers, bounded=False))
    described = (*(service for service, _ in services), health_service)
    for service, handlers in reflection_services(described):
        add_service(server, service, gate.guard(service, handlers, bounded=False))


async def bind_grpc_addresses(
    server: grpc.aio.Server,
    addresses: Iterable[str],
    tls: ServerTlsSource | None,
    unix_socket_mode: int,
) -> tuple[int, list[str]]:
    """Bind ``server`` to ``addresses`` (``HOST:PORT`` or ``unix:PATH``), with TLS when
    ``tls`` is given. Returns the first TCP port bound (0: none) and the ``unix:PATH``
    addresses. A socket is created the owner's alone and then given
    ``unix_socket_mode``, before the server starts accepting on it.

    Raises:
        ListenError: an address cannot be bound (taken since it was checked); the server
            is stopped first.
    """
    first_port = 0
    unix_sockets: list[str] = []
    for address in addresses:
        unix = is_unix_address(address)
        if not unix:
            host, port = split_host_port(address, "listen")
        target = address if unix else join_host_port(host, port)
        try:
            with private_umask():
                if tls is not None:
                    bound = server.add_secure_port(target, tls.grpc_credentials())
                else:
                    bound = server.add_insecure_port(target)
        except RuntimeError:  # taken since the check: gRPC says "Failed to bind to address"
            bound = 0
        if bound and unix:
            set_unix_socket_mode(address, unix_socket_mode)
        if bound == 0:
            await server.stop(None)  # else its finaliser runs on a closed loop
            raise ListenError(address, "gRPC", LISTEN_FLAG, "the address cannot be bound")
        if unix:
            unix_sockets.append(address)
        elif not first_port:
            first_port = bound
    return first_port, unix_sockets


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _passthrough(message: bytes) -> bytes:
    """The response serializer of WatchEvents: its handler already wrote protobuf bytes."""
    return message


def _own_bytes(message: Any) -> bytes:
    """The response serializer of Step and Allocate: their reply (a message, or a
    :class:`~kvsvc.server.calls.WrittenReply` holding the bytes) serializes itself."""
    data: bytes = message.SerializeToString()
    return data


class _Recorder:
    """Stands in for a server to capture the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below name the same methods."""

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers = dict(handlers)


def recorded_handlers(
    add: Callable[[Any, Any], None], servicer: Any
) -> dict[str, grpc.RpcMethodHandler]:
    """The handlers (method name -> handler) that ``add`` (a generated
    ``add_*Servicer_to_server``) would register for ``servicer``."""
    recorder = _Recorder()
    add(servicer, recorder)
    assert recorder.handlers, "generated registration changed: no handlers recorded"
    return recorder.handlers


def kvcache_method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The generated KVCacheService handlers of ``servicer``, WatchEvents's replaced by one
    whose messages are bytes (``servicer.WatchEvents`` writes them with ``context.write``)."""
    handlers = recorded_handlers(kvcache_pb2_grpc.add_KVCacheServiceServicer_to_server, servicer)
    assert "WatchEvents" in handlers, "generated registration changed: no WatchEvents handler"
    step = handlers["Step"]
    # Step's request is read by its raw codec (kvsvc.server.transports.codecs), as over
    # frames, and its reply is the bytes the handler wrote.
    handlers["Step"] = grpc.unary_unary_rpc_method_handler(
        step.unary_unary,  # type: ignore[attr-defined]
        request_deserializer=request_parser(
            f"/{KVCACHE_SERVICE}/Step",
            step.request_deserializer,  # type: ignore[attr-defined]
        ),
        # Its reply: a StepReply (the bytes already written) or, for a retried call, the
        # message of the reply kept; each gives its bytes.
        response_serializer=_own_bytes,
    )
    allocate = handlers["Allocate"]
    # Allocate's reply: an AllocateReply (the bytes the handler wrote) or a message.
    handlers["Allocate"] = grpc.unary_unary_rpc_method_handler(
        allocate.unary_unary,  # type: ignore[attr-defined]
        request_deserializer=allocate.request_deserializer,  # type: ignore[attr-defined]
        response_serializer=_own_bytes,
    )
    handlers["WatchEvents"] = grpc.unary_stream_rpc_method_handler(
        servicer.WatchEvents,
        request_deserializer=kvcache_pb2.WatchEventsRequest.FromString,
        response_serializer=_passthrough,
    )
    return handlers


def add_service(
    server: grpc.aio.Server | grpc.Server,
    service: str,
    handlers: dict[str, grpc.RpcMethodHandler],
) -> None:
    """Register ``handlers`` as the generated code registers a service's."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)  # type: ignore[attr-defined]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to kvsvc services without a credential of a role that may make them.

    The check runs here, before the request message is read, so every method of every
    kvsvc service is covered in one place (a new method cannot be left open by forgetting
    a decorator) and a large unauthenticated message is neither parsed nor held: the
    refusal goes out before it arrives.
    """

    def __init__(self, credentials: Credentials, observer: CallObserver) -> None:
        self._credentials = credentials
        self._observer = observer
        self._log = RateLimitedLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        allowed = roles_for_method(method)
        if allowed is None:
            return await continuation(handler_call_details)
        header: str | bytes | None = None
        for key, value in handler_call_details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == "authorization":
                header = value
                break
        handler = await continuation(handler_call_details)
        if handler is None:
            # No such method (``/kvsvc.v1.KVCacheService/Nope``): gRPC answers
            # UNIMPLEMENTED, whoever asks; there is nothing to refuse or to wrap.
            return None
        decision = authorize(self._credentials, header, method, allowed)
        if isinstance(decision, Refusal):
            return self._deny(handler, method, decision)
        if Role.ENGINE in allowed:
            return _as_caller(handler, decision, decision.engine, decision.pools)
        return _as_caller(handler, decision, "", None)

    def _deny(
        self, handler: grpc.RpcMethodHandler, method: str, refusal: Refusal
    ) -> grpc.RpcMethodHandler:
        log = self._log
        observer = self._observer

        async def deny(requests: Any, context: grpc.aio.ServicerContext) -> None:
            report_refusal(log, observer, method, refusal, context.peer())
            await context.abort(refusal.code, refusal.reason)

        def skip(_: bytes) -> None:
            return None

        # Registered as request-streaming, whatever the method is: gRPC then hands the
        # handler the requests as a stream it never reads, so the refusal is answered
        # before the message arrives. A unary handler would receive the whole message
        # first (up to max_message_bytes per call, held in memory while it arrives):
        # four unauthenticated 60 MiB calls held ~540 MiB that way, ~8 MiB this way (what
        # HTTP/2 flow control lets a peer send unasked).
        if handler.response_streaming:  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(deny, request_deserializer=skip)
        return grpc.stream_unary_rpc_method_handler(deny, request_deserializer=skip)


def _as_caller(
    handler: grpc.RpcMethodHandler,
    credential: Credential,
    engine: str,
    pools: frozenset[str] | None,
) -> grpc.RpcMethodHandler:
    """``handler`` (as the gate registered it: its requests read by the handler) run for
    ``credential``: :data:`current_caller` (whose request budget it reads under),
    :data:`current_engine` (its request-id namespace) and :data:`current_pools` (the pools
    its token may use) set for the call."""
    serializer = handler.response_serializer  # type: ignore[attr-defined]
    if handler.response_streaming:  # type: ignore[attr-defined]
        inner_stream = handler.stream_stream  # type: ignore[attr-defined]

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            current_caller.set(credential)
            current_engine.set(engine)
            current_pools.set(pools)
            async for message in inner_stream(requests, context):
                yield message

        return grpc.stream_stream_rpc_method_handler(stream, None, serializer)
    inner = handler.stream_unary  # type: ignore[attr-defined]

    async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        current_caller.set(credential)
        current_engine.set(engine)
        current_pools.set(pools)
        return await inner(requests, context)

    return grpc.stream_unary_rpc_method_handler(unary, None, serializer)
