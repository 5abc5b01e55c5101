"""Registering the server's services with handlers it can wrap.

The generated ``add_*Servicer_to_server`` functions register a servicer's handlers
directly; here they are recorded first (:func:`recorded_handlers`), so the server can wrap
each one (:mod:`kvsvc.server.gate`: malformed bodies, calls in flight) before registering
them (:func:`add_service`).

KVCacheService's WatchEvents is also replaced by one that sends pre-serialized bytes.
Every subscriber of a pool gets the same event batches; the generated registration
serializes each message once per stream (``WatchEventsResponse.SerializeToString``), so a
batch of 256 events cost ~40 us per subscriber before gRPC even saw it. Here the
WatchEvents handler writes the bytes :class:`~kvsvc.server.events.EventLog` serialized
once, and its response serializer passes them through: the wire format is exactly the
generated one (the same message, serialized by protobuf), only the work is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc

SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"].full_name


def _passthrough(message: bytes) -> bytes:
    """The response serializer of WatchEvents: its handler already wrote protobuf bytes."""
    return message


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
