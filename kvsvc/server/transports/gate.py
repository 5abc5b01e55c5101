"""What every gRPC method of the server goes through around its handler: the request's
bytes, reserved before they are read; a request body that does not parse; and the bounds
on calls in flight.

**Request bytes, before they are read.** gRPC reads a unary call's whole message before
it runs the handler (and the deserializer), so counting a call from its handler on
bounded nothing: eight concurrent 60 MiB Lookups peaked at 1.2 GB. Here every method is
registered as one whose requests the handler reads itself (request-streaming, a wire
format the same as unary: the client sends one message either way), and the wrapper
reads it only once :class:`~kvsvc.server.transports.budget.RequestBudget` has granted
``max_message_bytes`` for it (the size is not known before it is read); the message's real
size is then held until the call ends. Until it reads, gRPC buffers what HTTP/2 flow
control lets the client send unasked: one stream window (64 KiB, BDP probing being off on
this server, see :func:`~kvsvc.server.transports.grpc_listener.create_grpc_server`). A
read that does not complete within ``grpc_read_timeout_s`` ends the call
RESOURCE_EXHAUSTED (a client that sent all but the last byte holds nothing for long).
Every method reads this way, health and reflection (which anyone may call) included; a
caller is its credential (:data:`current_caller`, set by the auth interceptor) or its
peer's host (a credential's callers on several hosts read each on their own).

**Malformed bodies.** Bytes that do not parse as the method's request message are
answered INVALID_ARGUMENT (one rate-limited line on the security log by
:func:`~kvsvc.server.transports.auth.report_malformed`, no traceback), as the framed
transport does; gRPC's own deserializer would log a traceback and answer UNKNOWN (the
sync server of ``kvsvc router``: INTERNAL, :func:`guard_malformed_sync`).

**Calls in flight** (:class:`InflightLimits`), counted per kind of caller so one cannot
starve another: the engines' and operators' unary calls (KVCache and Admin services), the
agents' calls and plan streams (Worker service), and the subscribers' streams
(WatchEvents, SnapshotIndex, SnapshotPool). A call past its bound is answered
RESOURCE_EXHAUSTED naming the setting before its message is read; it changes nothing.
Calls refused by auth never reach here. Framed calls are bounded by the framed listener's
connections and share the request budget.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import ctypes.util
import inspect
import logging
import traceback
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass
from typing import Any

import grpc

from kvsvc.server.config import (
    DEFAULT_GRPC_READ_TIMEOUT_S,
    DEFAULT_MAX_INFLIGHT_AGENT_CALLS,
    DEFAULT_MAX_INFLIGHT_CALLS,
    DEFAULT_MAX_INFLIGHT_REQUEST_BYTES,
    DEFAULT_MAX_INFLIGHT_STREAMS,
    DEFAULT_MAX_MESSAGE_BYTES,
)
from kvsvc.server.errors import CallObserver
from kvsvc.server.request_caps import SMALL_REQUEST_BYTES, RequestCaps
from kvsvc.server.seclog import RateLimitedLog
from kvsvc.server.transports.auth import peer_host, report_malformed
from kvsvc.server.transports.budget import LARGE_REQUEST_BYTES, RequestBudget

log = logging.getLogger("kvsvc.server")


class Malformed:
    """A request whose bytes do not parse as the method's request message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


# Who the call is for the request budget: its credential (set by the auth interceptor);
# None: the peer's host (a server without tokens, or an open service: health, reflection).
current_caller: contextvars.ContextVar[Hashable | None] = contextvars.ContextVar(
    "kvsvc_caller", default=None
)


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``parse`` (a message's ``FromString``), returning :class:`Malformed` instead of
    raising."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, and whatever else a parser may raise
            return Malformed(str(exc) or type(exc).__name__)

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
    """Bounds on gRPC calls in flight and the request bytes read (config keys of the same
    names, but ``max_message_bytes``: what one message may be, reserved for each read)."""

    max_inflight_calls: int = DEFAULT_MAX_INFLIGHT_CALLS
    max_inflight_request_bytes: int = DEFAULT_MAX_INFLIGHT_REQUEST_BYTES
    max_inflight_agent_calls: int = DEFAULT_MAX_INFLIGHT_AGENT_CALLS
    max_inflight_streams: int = DEFAULT_MAX_INFLIGHT_STREAMS
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grpc_read_timeout_s: float = DEFAULT_GRPC_READ_TIMEOUT_S


# Kinds of calls, each with its own bound.
ENGINE, AGENT, STREAM = "engine", "agent", "stream"
_WORKER_SERVICE = "kvsvc.v1.WorkerService"


class CallGate:
    """Wraps method handlers with the request budget, the malformed-body answer and the
    in-flight bounds."""

    def __init__(
        self,
        limits: InflightLimits,
        observer: CallObserver,
        budget: RequestBudget | None = None,
        caps: RequestCaps | None = None,
    ) -> None:
        """``budget``: the server's request budget (shared with the framed listener); by
        default one of ``limits``' own. ``caps``: each method's request bound (by default
        ``max_message_bytes`` for all): a larger request is refused before it is parsed."""
        self.limits = limits
        self.caps = caps
        self._observer = observer
        self.budget = budget or RequestBudget(
            limits.max_inflight_request_bytes, limits.max_message_bytes
        )
        self.inflight = {ENGINE: 0, AGENT: 0, STREAM: 0}
        self.num_refused = 0
        self._log = RateLimitedLog()

    def guard(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler], *, bounded: bool = True
    ) -> dict[str, grpc.RpcMethodHandler]:
        """``handlers`` (method name -> handler) of ``service``, each wrapped; with
        ``bounded`` False (health, reflection) the calls in flight are not counted (the
        request budget and the malformed-body answer apply)."""
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
        """``handler`` registered request-streaming: its message is read by the wrapper,
        under the budget. A handler that already streams its requests (reflection) gets
        them one by one, each read the same way."""
        parse = tolerant(handler.request_deserializer or _raw)  # type: ignore[attr-defined]
        serialize = handler.response_serializer  # type: ignore[attr-defined]
        gate = self
        if handler.request_streaming:  # type: ignore[attr-defined]
            inner_both = handler.stream_stream  # type: ignore[attr-defined]
            assert inner_both is not None, f"{method}: a client-streaming method with one reply"

            async def both(_: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await gate._enter(kind, method, context)
                try:
                    messages = gate._messages(method, parse, context, _caller(context))
                    async for message in inner_both(messages, context):
                        yield message
                except BaseException as exc:
                    forget_frames(exc)
                    raise
                finally:
                    gate._leave(kind)

            return grpc.stream_stream_rpc_method_handler(both, None, serialize)
        if not handler.response_streaming:  # type: ignore[attr-defined]
            inner = handler.unary_unary  # type: ignore[attr-defined]

            async def unary(_: Any, context: grpc.aio.ServicerContext) -> Any:
                await gate._enter(kind, method, context)
                caller = _caller(context)
                size = 0  # held once read
                try:
                    request, size = await gate._receive(method, parse, context, caller)
                    return await inner(request, context)
                except BaseException as exc:
                    request = None  # not kept by this frame, which the error refers to
                    forget_frames(exc)
                    raise
                finally:
                    gate.budget.release(caller, size)
                    gate._leave(kind)

            return grpc.stream_unary_rpc_method_handler(unary, None, serialize)
        inner_stream = handler.unary_stream  # type: ignore[attr-defined]
        if inspect.isasyncgenfunction(inner_stream):

            async def stream(_: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await gate._enter(kind, method, context)
                try:
                    caller = _caller(context)
                    request, size = await gate._receive(method, parse, context, caller)
                    # A stream's request is small and read at its start: it is held
                    # while the stream lives only in the count of streams.
                    gate.budget.release(caller, size)
                    async for message in inner_stream(request, context):
                        yield message
                except BaseException as exc:
                    request = None
                    forget_frames(exc)
                    raise
                finally:
                    gate._leave(kind)

            return grpc.stream_stream_rpc_method_handler(stream, None, serialize)

        async def writer(_: Any, context: grpc.aio.ServicerContext) -> None:
            # A streaming handler that writes with context.write (grpc_health's Watch,
            # WatchEvents).
            await gate._enter(kind, method, context)
            try:
                caller = _caller(context)
                request, size = await gate._receive(method, parse, context, caller)
                gate.budget.release(caller, size)
                await inner_stream(request, context)
            except BaseException as exc:
                request = None
                forget_frames(exc)
                raise
            finally:
                gate._leave(kind)

        return grpc.stream_stream_rpc_method_handler(writer, None, serialize)

    async def _receive(
        self,
        method: str,
        parse: Callable[[bytes], Any],
        context: grpc.aio.ServicerContext,
        caller: Hashable,
    ) -> tuple[Any, int]:
        """Read the call's one message under the budget; the parsed request and the bytes
        it holds (released with ``caller`` when the call ends)."""
        data = await self._read(method, context, caller)
        if data is None:
            await self._refuse_malformed(method, Malformed("no request message was sent"), context)
        assert data is not None
        await self._check_cap(method, len(data), context, caller)
        return await self._parse(method, parse, data, context, caller), len(data)

    async def _messages(
        self,
        method: str,
        parse: Callable[[bytes], Any],
        context: grpc.aio.ServicerContext,
        caller: Hashable,
    ) -> AsyncIterator[Any]:
        """The messages of a request stream, each read under the budget and held until the
        handler asks for the next."""
        while True:
            data = await self._read(method, context, caller)
            if data is None:
                return
            await self._check_cap(method, len(data), context, caller)
            try:
                yield await self._parse(method, parse, data, context, caller)
            finally:
                self.budget.release(caller, len(data))

    async def _read(
        self, method: str, context: grpc.aio.ServicerContext, caller: Hashable
    ) -> bytes | None:
        """The next request message's bytes (None: the client sent no more), read once
        the budget grants what it may be; they are held from then on (released by the
        caller)."""
        reserved = self.limits.max_message_bytes
        if not self.budget.try_reserve(caller, reserved):
            await self.budget.reserve(caller, reserved)
        try:
            # asyncio.timeout, not wait_for: no task of its own for every read.
            async with asyncio.timeout(self.limits.grpc_read_timeout_s):
                data = await context.read()
        except TimeoutError:
            self.budget.cancel(caller, reserved)
            await self._refuse(
                method,
                context,
                f"the request message did not arrive within grpc_read_timeout_s "
                f"({self.limits.grpc_read_timeout_s:g} s)",
            )
        except BaseException:
            self.budget.cancel(caller, reserved)
            raise
        if data is grpc.aio.EOF:
            self.budget.cancel(caller, reserved)
            return None
        assert isinstance(data, bytes)
        if len(data) > LARGE_REQUEST_BYTES:
            trim_heap()
        if not self.budget.received(caller, reserved, len(data)):
            await self._refuse(
                method,
                context,
                f"the server holds {self.budget.held} bytes of requests in flight; this "
                f"one's {len(data)} would pass its bound (max_inflight_request_bytes="
                f"{self.budget.total}); retry, or raise it",
            )
        return data

    async def _check_cap(
        self, method: str, size: int, context: grpc.aio.ServicerContext, caller: Hashable
    ) -> None:
        """Refuse a request over its method's cap (:mod:`kvsvc.server.request_caps`)
        before it is parsed; its bytes are let go."""
        caps = self.caps
        if caps is None or size <= SMALL_REQUEST_BYTES:
            return
        cap = caps(method)
        if size > cap:
            self.budget.release(caller, size)
            await self._refuse(method, context, caps.refusal(method, size, cap))

    async def _parse(
        self,
        method: str,
        parse: Callable[[bytes], Any],
        data: bytes,
        context: grpc.aio.ServicerContext,
        caller: Hashable,
    ) -> Any:
        request = parse(data)
        if type(request) is Malformed:
            self.budget.release(caller, len(data))
            await self._refuse_malformed(method, request, context)
        return request

    async def _refuse_malformed(
        self, method: str, request: Malformed, context: grpc.aio.ServicerContext
    ) -> None:
        report_malformed(method, context.peer())
        self._observer.observe(method.rpartition("/")[2], grpc.StatusCode.INVALID_ARGUMENT, 0.0)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed_details(method, request))

    async def _enter(
        self, kind: str | None, method: str, context: grpc.aio.ServicerContext
    ) -> None:
        """Count the call in, or answer RESOURCE_EXHAUSTED when it is past its bound."""
        if kind is None:
            return
        limits = self.limits
        count = self.inflight[kind]
        if kind == ENGINE:
            bound, key = limits.max_inflight_calls, "max_inflight_calls"
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

    def _leave(self, kind: str | None) -> None:
        if kind is not None:
            self.inflight[kind] -= 1

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, details: str) -> None:
        self.num_refused += 1
        short = method.rpartition("/")[2]
        self._log.warning(f"inflight:{short}", "bound hit: %s: %s", short, details)
        self._observer.observe(short, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library is glibc (None elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_malloc_trim = _find_malloc_trim()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system, once a large message is in.

    gRPC assembles a message in many small buffers on its own threads, each thread
    allocating from its own malloc arena; freed once the message is a Python bytes object,
    they stay resident in that arena, and the next large message, assembled on another
    thread, adds its own: sixteen 60 MiB messages read one after another grew the server
    by 250 MiB where one grows it by 180. The buffers of the message just read are free by
    now; trimming costs well under a millisecond and runs once per large message.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def _caller(context: grpc.aio.ServicerContext) -> Hashable:
    """Whose reads the call's count with: its credential (None without) on its host. One
    client reads one large request at a time; the same token on other hosts does not wait
    for it."""
    return (current_caller.get(), peer_host(context.peer() or "?"))


def forget_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames ``error`` (and the errors it chains) went
    through: a handler's request among them.

    A call that ends with an error (an INVALID_ARGUMENT abort, raised while the domain
    error is being handled) leaves gRPC an exception whose tracebacks refer to the frames
    of the handlers; gRPC keeps it in a reference cycle, freed only when the collector
    runs (rarely, in ``kvsvc serve``'s settings). Each refused 60 MiB Lookup kept its
    parsed request (60 MiB) that way, so eight of them in a row held 650 MB while the
    request budget counted none of it.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # skips frames still running
        pending += (current.__context__, current.__cause__)


def _raw(data: bytes) -> bytes:
    """The request "parser" of a method registered with bytes for requests."""
    return data
