"""What every gRPC method of the server goes through around its handler: a request body
that does not parse, and the bounds on calls in flight.

**Malformed bodies.** gRPC runs a method's request deserializer before any handler; one
that raises makes gRPC log a traceback and answer UNKNOWN (the sync server of ``kvsvc
router``: INTERNAL). Here the deserializer never raises: bytes that do not parse become a
:class:`Malformed` request, which the handler's wrapper answers INVALID_ARGUMENT (one
rate-limited line on the security log by
:func:`~kvsvc.server.transports.auth.report_malformed`, no traceback), as the framed
transport does.

**Calls in flight** (:class:`InflightLimits`), counted per kind of caller so one cannot
starve another: the engines' and operators' unary calls (KVCache and Admin services; by
count and by request bytes), the agents' calls and plan streams (Worker service), and the
subscribers' streams (WatchEvents, SnapshotIndex, SnapshotPool). A call past its bound is answered
RESOURCE_EXHAUSTED naming the setting, before its handler runs; it changes nothing. A
call is counted from when its message has arrived (gRPC reads it before any handler) to
its end. Calls refused by auth never reach here. Framed calls are bounded by the framed
listener's connections instead (one call at a time each).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvsvc.server.config import (
    DEFAULT_MAX_INFLIGHT_AGENT_CALLS,
    DEFAULT_MAX_INFLIGHT_CALLS,
    DEFAULT_MAX_INFLIGHT_REQUEST_BYTES,
    DEFAULT_MAX_INFLIGHT_STREAMS,
)
from kvsvc.server.errors import CallObserver
from kvsvc.server.seclog import RateLimitedLog
from kvsvc.server.transports.auth import report_malformed

log = logging.getLogger("kvsvc.server")


class Malformed:
    """A request whose bytes do not parse as the method's request message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _Received:
    """A parsed request and the bytes it came in (what the in-flight bound counts)."""

    __slots__ = ("message", "size")

    def __init__(self, message: Any, size: int) -> None:
        self.message = message
        self.size = size


def tolerant(parse: Callable[[bytes], Any], sized: bool = False) -> Callable[[bytes], Any]:
    """``parse`` (a message's ``FromString``), returning :class:`Malformed` instead of
    raising; with ``sized``, the message wrapped with its byte count."""

    def deserialize(data: bytes) -> Any:
        try:
            message = parse(data)
        except Exception as exc:  # DecodeError, and whatever else a parser may raise
            return Malformed(str(exc) or type(exc).__name__)
        return _Received(message, len(data)) if sized else message

    return deserialize


def malformed_details(method: str, request: Malformed) -> str:
    """The message a caller gets for a body that does not parse."""
    return (
        f"the request message does not parse as {method.rpartition('/')[2]}'s request: "
        f"{request.error}"
    )


def guard_malformed_sync(
    service: str, handlers: dict[str, grpc.RpcMethodHandler]
) -> dict[str, grpc.RpcMethodHandler]:
    """The malformed-body answer for a synchronous gRPC server's unary-request handlers
    (``kvsvc router``'s), which would otherwise answer INTERNAL with a traceback."""
    guarded: dict[str, grpc.RpcMethodHandler] = {}
    for name, handler in handlers.items():
        method = f"/{service}/{name}"
        deserialize = tolerant(handler.request_deserializer)  # type: ignore[attr-defined]
        serialize = handler.response_serializer  # type: ignore[attr-defined]
        streaming = handler.response_streaming  # type: ignore[attr-defined]
        inner = handler.unary_stream if streaming else handler.unary_unary  # type: ignore[attr-defined]

        def behavior(request: Any, context: Any, inner: Any = inner, method: str = method) -> Any:
            if type(request) is Malformed:
                report_malformed(method, context.peer())
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed_details(method, request))
            return inner(request, context)

        make = (
            grpc.unary_stream_rpc_method_handler
            if streaming
            else grpc.unary_unary_rpc_method_handler
        )
        guarded[name] = make(behavior, deserialize, serialize)
    return guarded


@dataclass(frozen=True, slots=True)
class InflightLimits:
    """Bounds on gRPC calls in flight (config keys of the same names)."""

    max_inflight_calls: int = DEFAULT_MAX_INFLIGHT_CALLS
    max_inflight_request_bytes: int = DEFAULT_MAX_INFLIGHT_REQUEST_BYTES
    max_inflight_agent_calls: int = DEFAULT_MAX_INFLIGHT_AGENT_CALLS
    max_inflight_streams: int = DEFAULT_MAX_INFLIGHT_STREAMS


# Kinds of calls, each with its own bound.
ENGINE, AGENT, STREAM = "engine", "agent", "stream"
_WORKER_SERVICE = "kvsvc.v1.WorkerService"


class CallGate:
    """Wraps method handlers with the malformed-body answer and the in-flight bounds."""

    def __init__(self, limits: InflightLimits, observer: CallObserver) -> None:
        self.limits = limits
        self._observer = observer
        self.inflight = {ENGINE: 0, AGENT: 0, STREAM: 0}
        self.inflight_bytes = 0
        self.num_refused = 0
        self._log = RateLimitedLog()

    def guard(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler], *, bounded: bool = True
    ) -> dict[str, grpc.RpcMethodHandler]:
        """``handlers`` (method name -> handler) of ``service``, each wrapped; with
        ``bounded`` False (health) only the malformed-body answer applies."""
        return {
            name: self._wrap(f"/{service}/{name}", handler, self._kind(service, handler, bounded))
            for name, handler in handlers.items()
        }

    @staticmethod
    def _kind(service: str, handler: grpc.RpcMethodHandler, bounded: bool) -> str | None:
        if not bounded:
            return None
        if service == _WORKER_SERVICE:
            return AGENT
        return STREAM if handler.response_streaming else ENGINE  # type: ignore[attr-defined]

    def _wrap(
        self, method: str, handler: grpc.RpcMethodHandler, kind: str | None
    ) -> grpc.RpcMethodHandler:
        parse = handler.request_deserializer  # type: ignore[attr-defined]
        serialize = handler.response_serializer  # type: ignore[attr-defined]
        deserialize = tolerant(parse, sized=kind == ENGINE)
        gate = self
        if not handler.response_streaming:  # type: ignore[attr-defined]
            inner = handler.unary_unary  # type: ignore[attr-defined]

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if type(request) is Malformed:
                    await gate._refuse_malformed(method, request, context)
                size = 0
                if type(request) is _Received:
                    request, size = request.message, request.size
                await gate._enter(kind, size, method, context)
                try:
                    return await inner(request, context)
                finally:
                    gate._leave(kind, size)

            return grpc.unary_unary_rpc_method_handler(unary, deserialize, serialize)
        inner_stream = handler.unary_stream  # type: ignore[attr-defined]
        if inspect.isasyncgenfunction(inner_stream):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if type(request) is Malformed:
                    await gate._refuse_malformed(method, request, context)
                await gate._enter(kind, 0, method, context)
                try:
                    async for message in inner_stream(request, context):
                        yield message
                finally:
                    gate._leave(kind, 0)

            return grpc.unary_stream_rpc_method_handler(stream, deserialize, serialize)

        async def writer(request: Any, context: grpc.aio.ServicerContext) -> None:
            # A streaming handler that writes with context.write (grpc_health's Watch).
            if type(request) is Malformed:
                await gate._refuse_malformed(method, request, context)
            await gate._enter(kind, 0, method, context)
            try:
                await inner_stream(request, context)
            finally:
                gate._leave(kind, 0)

        return grpc.unary_stream_rpc_method_handler(writer, deserialize, serialize)

    async def _refuse_malformed(
        self, method: str, request: Malformed, context: grpc.aio.ServicerContext
    ) -> None:
        report_malformed(method, context.peer())
        self._observer.observe(method.rpartition("/")[2], grpc.StatusCode.INVALID_ARGUMENT, 0.0)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed_details(method, request))

    async def _enter(
        self, kind: str | None, size: int, method: str, context: grpc.aio.ServicerContext
    ) -> None:
        """Count the call in, or answer RESOURCE_EXHAUSTED when it is past its bound."""
        if kind is None:
            return
        limits = self.limits
        count = self.inflight[kind]
        if kind == ENGINE:
            bound, key = limits.max_inflight_calls, "max_inflight_calls"
            if count and self.inflight_bytes + size > limits.max_inflight_request_bytes:
                await self._refuse(
                    method,
                    context,
                    f"the server holds {self.inflight_bytes} bytes of requests in flight; "
                    f"this one's {size} would pass its bound (max_inflight_request_bytes="
                    f"{limits.max_inflight_request_bytes}); retry, or raise it",
                )
        elif kind == AGENT:
            bound, key = limits.max_inflight_agent_calls, "max_inflight_agent_calls"
        else:
            bound, key = limits.max_inflight_streams, "max_inflight_streams"
        if count >= bound:
            what = "streams" if kind == STREAM else f"{kind} calls"
            await self._refuse(
                method,
                context,
                f"the server has {count} {what} in flight, its bound ({key}={bound}); "
                "retry, or raise it",
            )
        self.inflight[kind] = count + 1
        self.inflight_bytes += size

    def _leave(self, kind: str | None, size: int) -> None:
        if kind is not None:
            self.inflight[kind] -= 1
            self.inflight_bytes -= size

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, details: str) -> None:
        self.num_refused += 1
        short = method.rpartition("/")[2]
        self._log.warning(f"inflight:{short}", "bound hit: %s: %s", short, details)
        self._observer.observe(short, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
