"""The one place where kvsvc errors become gRPC status codes.

Handlers raise :mod:`kvsvc.errors` exceptions; :func:`rpc_handler` turns them into the
status code of :data:`STATUS_FOR`. Anything else is a bug: it is logged with its traceback
under an incident id and the caller gets INTERNAL with that id — never ``str(err)``,
which could leak internals.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvsvc.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvsvcError,
    NotFound,
    PermissionDenied,
    PlanningError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvsvc.server.namespace import unscope_message
from kvsvc.server.seclog import RateLimitedLog

log = logging.getLogger("kvsvc.server")
# Bounds hit (RESOURCE_EXHAUSTED), one line per method per 10 s at most.
_limits_log = RateLimitedLog()

STATUS_FOR: dict[type[KvsvcError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    PlanningError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_for(error: KvsvcError) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        code = STATUS_FOR.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN


class CallObserver:
    """Receives the outcome of every handled call (the metrics module implements it)."""

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Record one finished call."""


_Handler = TypeVar("_Handler", bound=Callable[..., Awaitable[Any]])


async def _abort_internal(context: grpc.aio.ServicerContext, method: str) -> None:
    """A bug: log the traceback under an incident id; tell the caller only the id."""
    incident = uuid.uuid4().hex[:12]
    log.exception("internal error in %s (incident %s)", method, incident)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error (incident {incident}; see the server log)"
    )


def rpc_handler(method: str) -> Callable[[_Handler], _Handler]:
    """Wrap a unary servicer method: error mapping and call accounting.

    The servicer must have ``_observer: CallObserver``. Authentication is not done here
    but by the listeners (:mod:`kvsvc.server.transports`), once for every method.
    """

    def decorate(fn: _Handler) -> _Handler:
        @functools.wraps(fn)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return await fn(self, request, context)
            except KvsvcError as exc:
                code = status_for(exc)
                message = unscope_message(str(exc))
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    _limits_log.warning(method, "bound hit: %s: %s", method, message)
                await context.abort(code, message)
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[assignment]
                raise
            except Exception:
                code = grpc.StatusCode.INTERNAL
                await _abort_internal(context, method)
            finally:
                self._observer.observe(method, code, time.perf_counter() - started)

        return wrapper  # type: ignore[return-value]

    return decorate


SHUTTING_DOWN = "the server is shutting down; reconnect (to it once restarted, or another)"


class OpenStreams:
    """The streaming calls in progress (WatchEvents, WatchPlan, snapshots), so that a
    graceful stop ends them at once with UNAVAILABLE: they never end by themselves, and
    gRPC's grace period waited for them in full (5 s) and then cancelled them with a
    CancelledError traceback each."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.closing = False

    def add(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._tasks.add(task)

    def discard(self, task: asyncio.Task[Any] | None) -> None:
        self._tasks.discard(task)  # type: ignore[arg-type]

    def close(self) -> None:
        """End every open stream (UNAVAILABLE) and refuse new ones."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()


def rpc_stream_handler(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """:func:`rpc_handler` for server-streaming methods (async generators). The servicer's
    ``_pools.streams`` (an :class:`OpenStreams`) knows the stream while it runs."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            streams: OpenStreams = self._pools.streams
            task = asyncio.current_task()
            streams.add(task)
            try:
                if streams.closing:
                    raise Unavailable(SHUTTING_DOWN)
                async for message in fn(self, request, context):
                    yield message
            except KvsvcError as exc:
                code = status_for(exc)
                await context.abort(code, unscope_message(str(exc)))
            except grpc.aio.AbortError:
                code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[assignment]
                raise
            except (GeneratorExit, asyncio.CancelledError):
                if streams.closing and task is not None and task.cancelling():
                    task.uncancel()  # ended by the stop, not by the caller: say why
                    code = grpc.StatusCode.UNAVAILABLE
                    await context.abort(code, SHUTTING_DOWN)
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception:
                code = grpc.StatusCode.INTERNAL
                await _abort_internal(context, method)
            finally:
                streams.discard(task)
                self._observer.observe(method, code, time.perf_counter() - started)

        return wrapper

    return decorate
