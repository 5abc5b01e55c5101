"""Registering KVCacheService with a WatchEvents that sends pre-serialized bytes.

Every subscriber of a pool gets the same event batches; the generated registration
serializes each message once per stream (``WatchEventsResponse.SerializeToString``), so a
batch of 256 events cost ~40 us per subscriber before gRPC even saw it. Here the
WatchEvents handler writes the bytes :class:`~kvsvc.server.events.EventLog` serialized
once, and its response serializer passes them through: the wire format is exactly the
generated one (the same message, serialized by protobuf), only the work is shared.
"""

from __future__ import annotations

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


def kvcache_method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The generated KVCacheService handlers of ``servicer``, WatchEvents's replaced by one
    whose messages are bytes (``servicer.WatchEvents`` writes them with ``context.write``)."""
    recorder = _Recorder()
    kvcache_pb2_grpc.add_KVCacheServiceServicer_to_server(servicer, recorder)
    handlers = recorder.handlers
    assert "WatchEvents" in handlers, "generated registration changed: no WatchEvents handler"
    handlers["WatchEvents"] = grpc.unary_stream_rpc_method_handler(
        servicer.WatchEvents,
        request_deserializer=kvcache_pb2.WatchEventsRequest.FromString,
        response_serializer=_passthrough,
    )
    return handlers


def add_kvcache_service(servicer: Any, server: grpc.aio.Server) -> None:
    """What ``add_KVCacheServiceServicer_to_server`` does, with the WatchEvents above."""
    handlers = kvcache_method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)  # type: ignore[attr-defined]
