"""The blocking engine client."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

import grpc

from kvsvc.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc
from kvsvc_client import _wire
from kvsvc_client._common import RETRYABLE, RETRYABLE_REPEATS, ClientOptions
from kvsvc_client._types import (
    AllocateResult,
    BlockTable,
    EventBatch,
    HashingContext,
    PoolInfo,
    RequestStart,
    Usage,
)
from kvsvc_client.errors import (
    KVCacheError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
    error_from_rpc,
)

_T = TypeVar("_T")


class SyncStep(_wire.StepBuilder):
    """A step builder bound to a client: ``send()`` runs the Step RPC."""

    def __init__(self, client: KVCacheClient) -> None:
        super().__init__(client.pool)
        self._client = client

    def send(self, timeout: float | None = None) -> _wire.StepResultList:
        """Apply the operations in order; one result per operation (never retried)."""
        response = self._client._call(self._client._stub.Step, self.to_pb(), timeout, retry=False)
        return self.parse(response)

    def send_future(self, timeout: float | None = None) -> StepFuture:
        """Hand the Step to the client's sender thread and return at once; ``result()``
        waits for its results.

        Lets an engine overlap the call with its own work. One thread sends every Step of
        a client, so Steps sent this way are applied in the order they were sent. (gRPC's
        own ``future()`` starts a thread per call: several times dearer than the call.)
        """
        return StepFuture(self, self._client._sender().submit(self.send, timeout))


class StepFuture:
    """A Step sent by :meth:`SyncStep.send_future`."""

    def __init__(self, step: SyncStep, future: concurrent.futures.Future[Any]) -> None:
        self._step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def __repr__(self) -> str:
        return f"StepFuture({len(self._step)} operations, {'done' if self.done() else 'pending'})"

    def result(self) -> _wire.StepResultList:
        """The results, once the server applied the Step.

        Raises:
            KVCacheError: the call failed (UnavailableError when the server is gone).
        """
        return cast(_wire.StepResultList, self._future.result())


class KVCacheClient:
    """Engine-facing client of one pool.

    Every call has a deadline (``options.timeout``). Calls without side effects (lookup,
    block_table, usage, admin) are retried on UNAVAILABLE. Admissions (``allocate`` with
    ``start``) and ``free`` are retried on UNAVAILABLE and DEADLINE_EXCEEDED too, up to
    ``options.retries`` times: the server answers a repeated admission with the request's
    state and a repeated free with success, so a retry after a lost reply does no work
    twice. Later ``allocate`` calls and ``step`` are never retried.

    Example::

        with KVCacheClient("127.0.0.1:50051", pool="llama") as kv:
            r = kv.allocate("req-1", prompt_ids, num_new_tokens=512, start=True)
            if r.ok:
                ...
    """

    def __init__(
        self,
        target: str,
        pool: str,
        *,
        options: ClientOptions | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        self.pool = pool
        self.target = target
        self.options = options or ClientOptions()
        self._own_channel = channel is None
        self._channel = channel or self.options.channel(target)
        self._stub = kvcache_pb2_grpc.KVCacheServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._metadata = self.options.metadata()
        self._sender_lock = threading.Lock()
        self._step_sender: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._watches: set[Any] = set()  # open WatchEvents streams, cancelled by close()

    def __repr__(self) -> str:
        return f"KVCacheClient({self.target!r}, pool={self.pool!r})"

    def close(self) -> None:
        with self._sender_lock:
            self._closed = True  # watch_events then ends quietly, even on a shared channel
            watches, self._watches = self._watches, set()
            sender, self._step_sender = self._step_sender, None
        for stream in watches:
            stream.cancel()
        if sender is not None:
            sender.shutdown(wait=True)
        if self._own_channel:
            self._channel.close()

    def _sender(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one thread that sends this client's ``send_future`` Steps (made on first use)."""
        with self._sender_lock:
            if self._step_sender is None:
                self._step_sender = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="kvsvc-step"
                )
            return self._step_sender

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: Callable[..., _T],
        request: Any,
        timeout: float | None,
        retry: bool,
        codes: frozenset[grpc.StatusCode] = RETRYABLE,
    ) -> _T:
        """One RPC; with ``retry``, up to ``options.retries`` more after a status in
        ``codes`` (backing off between attempts)."""
        attempts = 1 + (self.options.retries if retry else 0)
        for attempt in range(attempts):
            try:
                return method(
                    request, timeout=timeout or self.options.timeout, metadata=self._metadata
                )
            except grpc.RpcError as exc:
                if attempt + 1 < attempts and exc.code() in codes:  # type: ignore[attr-defined]
                    time.sleep(self.options.delay(attempt))
                    continue
                raise error_from_rpc(exc) from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ engine calls

    def allocate(
        self,
        request_id: str,
        new_token_ids: Sequence[int] = (),
        num_new_tokens: int = 0,
        *,
        num_lookahead_tokens: int = 0,
        start: RequestStart | bool = False,
        timeout: float | None = None,
    ) -> AllocateResult:
        """Allocate slots for a request's next ``num_new_tokens`` tokens.

        Args:
            request_id: the engine's id of the request.
            new_token_ids: tokens appended since the last call (the whole prompt on the
                first call).
            num_new_tokens: tokens to compute this step (on the first call: a budget).
            num_lookahead_tokens: extra slots for speculative tokens.
            start: on the first call, ``True`` or a :class:`RequestStart` with the hashing
                context; ``False`` on later calls.

        A first call is retried after UNAVAILABLE or DEADLINE_EXCEEDED (``options.retries``
        times at most): if the lost attempt was applied, the retry answers the request's
        state as that admission left it (same blocks). Later calls are not retried.
        """
        request = _wire.allocate_request(
            self.pool, request_id, new_token_ids, num_new_tokens, num_lookahead_tokens, start
        )
        admission = request.HasField("start")
        return _wire.allocate_result(
            self._call(
                self._stub.Allocate, request, timeout, retry=admission, codes=RETRYABLE_REPEATS
            )
        )

    def free(self, *request_ids: str, preempted: bool = False, timeout: float | None = None) -> int:
        """Release requests; returns blocks whose last holder this was.

        Retried after UNAVAILABLE or DEADLINE_EXCEEDED (``options.retries`` times at most):
        ids the lost attempt freed count as freed already, so the retry succeeds (their
        blocks are not counted again: the result may then be lower than what was freed).
        """
        request = _wire.free_request(self.pool, request_ids, preempted)
        response = self._call(
            self._stub.Free, request, timeout, retry=True, codes=RETRYABLE_REPEATS
        )
        return response.num_freed_blocks

    def step(self) -> SyncStep:
        """A builder for one scheduling step's batch of operations."""
        return SyncStep(self)

    def lookup(
        self,
        token_ids: Sequence[int],
        hashing: HashingContext | None = None,
        *,
        timeout: float | None = None,
    ) -> int:
        """Cached prefix tokens of a prompt (no side effects)."""
        request = _wire.lookup_request(self.pool, token_ids, hashing)
        return self._call(self._stub.Lookup, request, timeout, retry=True).num_cached_tokens

    def block_table(self, request_id: str, *, timeout: float | None = None) -> BlockTable:
        request = kvcache_pb2.GetBlockTableRequest(pool=self.pool, request_id=request_id)
        return _wire.block_table(self._call(self._stub.GetBlockTable, request, timeout, retry=True))

    def usage(self, *, timeout: float | None = None) -> Usage:
        request = kvcache_pb2.GetUsageRequest(pool=self.pool)
        return _wire.usage(self._call(self._stub.GetUsage, request, timeout, retry=True))

    def reset_prefix_cache(self, *, timeout: float | None = None) -> bool:
        request = kvcache_pb2.ResetPrefixCacheRequest(pool=self.pool)
        return self._call(self._stub.ResetPrefixCache, request, timeout, retry=True).reset

    def watch_events(
        self,
        from_sequence: int | None = None,
        *,
        reconnect: bool = True,
        epoch: str = "",
        caught_up: bool = False,
    ) -> Iterator[EventBatch]:
        """Follow the pool's prefix-index events; the iteration never ends by itself.

        Each ``next()`` blocks until the pool's next batch (without ``from_sequence``: only
        batches made after the call; ``from_sequence=1``: everything still held first). To
        stop, ``break`` out of the loop (the stream is cancelled), or call :meth:`close`
        from another thread: the iteration then ends without an error.

        With ``caught_up=True`` the stream also yields a marker with ``caught_up=True`` (no
        events, sequence 0) once it has replayed up to the newest batch (at once when
        there is nothing to replay), and again after each reconnect's replay: from there
        on it is live.

        After a disconnect the iterator reconnects with backoff and resumes after the last
        batch it yielded, so nothing is missed while the server holds it; a batch with
        ``gap=True`` says what could not be replayed.
        """
        next_seq = from_sequence
        attempt = 0
        while True:
            request = kvcache_pb2.WatchEventsRequest(
                pool=self.pool, epoch=epoch, send_caught_up=caught_up
            )
            if next_seq is not None:
                request.from_sequence = next_seq
            with self._sender_lock:
                if self._closed:
                    return
                stream = self._stub.WatchEvents(request, metadata=self._metadata)
                self._watches.add(stream)
            try:
                for message in stream:
                    attempt = 0
                    batch = _wire.event_batch(message)
                    epoch = batch.epoch or epoch
                    next_seq = _wire.resume_sequence(batch)
                    yield batch
                return
            except grpc.RpcError as exc:
                if self._closed:
                    return  # close() from another thread: the caller asked it to end
                if not reconnect or exc.code() not in RETRYABLE:  # type: ignore[attr-defined]
                    raise error_from_rpc(exc) from None
                time.sleep(self.options.delay(attempt))
                attempt += 1
            finally:
                stream.cancel()
                with self._sender_lock:
                    self._watches.discard(stream)

    # ------------------------------------------------------------------ admin

    def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        response = self._call(
            self._admin.ListPools, admin_pb2.ListPoolsRequest(), timeout, retry=True
        )
        return [_wire.pool_info(p) for p in response.pools]

    def get_plan(
        self, pool: str | None = None, *, timeout: float | None = None
    ) -> admin_pb2.GetPlanResponse:
        request = admin_pb2.GetPlanRequest(pool=pool or self.pool)
        return self._call(self._admin.GetPlan, request, timeout, retry=True)

    def wait_until_ready(self, timeout: float = 60.0, poll: float = 0.1) -> PoolInfo:
        """Poll the admin view until the pool is READY (or DEGRADED); raise on timeout.

        A server that is not up yet is waited for; what waiting cannot fix raises at once:
        a token the server refuses, or a server that has no such pool.

        Raises:
            TimeoutError: not ready in time; the message has the last state seen (ranks
                registered, the planning error) or why the server was unreachable.
            UnauthenticatedError / PermissionDeniedError: the token.
            NotFoundError: the server has no pool of this name (the message lists its pools).
        """
        deadline = time.monotonic() + timeout
        info: PoolInfo | None = None
        unreachable = ""
        while True:
            try:
                pools = self.list_pools()
            except (UnauthenticatedError, PermissionDeniedError):
                raise
            except KVCacheError as exc:
                info, unreachable = None, str(exc)
            else:
                info = next((p for p in pools if p.name == self.pool), None)
                if info is None:
                    names = ", ".join(p.name for p in pools) or "none"
                    raise NotFoundError(
                        grpc.StatusCode.NOT_FOUND,
                        f"the server has no pool {self.pool!r} (its pools: {names})",
                    )
                if info.state in ("READY", "DEGRADED"):
                    return info
            if time.monotonic() + poll > deadline:
                break
            time.sleep(poll)
        if info is None:
            raise TimeoutError(
                f"pool {self.pool!r} not ready after {timeout:g}s: the server is unreachable "
                f"({unreachable})"
            )
        detail = f"; last error: {info.error}" if info.error else ""
        raise TimeoutError(
            f"pool {self.pool!r} not ready after {timeout:g}s: {info.state}, "
            f"{info.num_registered}/{info.world_size} ranks registered{detail}"
        )
