"""The blocking engine client."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import grpc

from kvsvc.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc
from kvsvc_client import _wire
from kvsvc_client._common import (
    RETRYABLE,
    RETRYABLE_REPEATS,
    ClientOptions,
    epoch_of_reply,
)
from kvsvc_client._frames import FrameUnaryMethod
from kvsvc_client._sender import StepSender, StepSlot
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
    NotReadyError,
    PermissionDeniedError,
    UnauthenticatedError,
    error_from_rpc,
)

_log = logging.getLogger("kvsvc_client")


class SyncStep(_wire.StepBuilder):
    """A step builder bound to a client: ``send()`` runs the Step RPC."""

    def __init__(self, client: KVCacheClient) -> None:
        super().__init__(client.pool)
        self._client = client

    def send(self, timeout: float | None = None) -> _wire.StepResultList:
        """Apply the operations in order; one result per operation.

        Retried after UNAVAILABLE or DEADLINE_EXCEEDED (see :class:`KVCacheClient`): the
        Step carries a call id, so a repeat of one the server applied answers its reply
        and applies nothing twice.
        """
        client = self._client
        client._settle_pipelined()
        request = self.to_pb()
        request.call_id = client._call_id()
        response = client._call(
            client._stub.Step, request, timeout, retry=True, codes=RETRYABLE_REPEATS, patient=True
        )
        return self.parse(response)

    def send_future(
        self,
        timeout: float | None = None,
        *,
        then: Callable[[_wire.StepResultList], Any] | None = None,
    ) -> StepFuture | PipelinedStep:
        """Send the Step without waiting for its reply; ``result()`` waits for its results.

        Lets an engine overlap the call with its own work. Steps sent this way are applied
        in the order they were sent. Over gRPC, the client's one sender thread makes the
        call (gRPC's own ``future()`` starts a thread per call: several times dearer than
        the call); over frames, the frame is written on this thread before this returns
        and the reply read when asked for (:class:`PipelinedStep`: no thread at all).

        ``then``: work on the results to run as soon as they are read, on the sender
        thread over gRPC (an engine's check of the reply, done while it computes rather
        than after); ``then_result()`` gives what it returned (or raises what it raised).
        """
        client = self._client
        if client._inline_steps:
            return client._pipeline(self, timeout, then)
        return StepFuture(self, client._sender().submit(lambda: self.send(timeout), then))


class StepFuture:
    """A Step sent by :meth:`SyncStep.send_future`."""

    def __init__(self, step: SyncStep, slot: StepSlot) -> None:
        self._step = step
        self._slot = slot

    def done(self) -> bool:
        """Whether the reply is in (and ``then`` has run): ``result()`` would not wait."""
        return self._slot.finished

    def __repr__(self) -> str:
        return f"StepFuture({len(self._step)} operations, {'done' if self.done() else 'pending'})"

    def result(self) -> _wire.StepResultList:
        """The results, once the server applied the Step.

        Raises:
            KVCacheError: the call failed (UnavailableError when the server is gone).
        """
        slot = self._slot
        slot.wait()
        if slot.error is not None:
            raise slot.error
        return cast(_wire.StepResultList, slot.results)

    def then_result(self) -> Any:
        """What ``send_future``'s ``then`` returned for the results (None without one).

        Raises:
            KVCacheError: the call failed; or whatever ``then`` raised.
        """
        self.result()
        slot = self._slot
        if slot.then_error is not None:
            raise slot.then_error
        return slot.then_value


class PipelinedStep:
    """A Step sent by :meth:`SyncStep.send_future` on a framed channel: written to the
    socket at once on the caller's thread, its reply read (and ``then`` run) on the
    thread that first asks for it, by when it has usually arrived.

    No thread is involved: handing a Step to one and taking its reply back costs two
    thread wake-ups and as many GIL hand-offs a step, several times the send itself, on
    an engine whose cores all run its forward pass. The frame goes out whole or not at
    all before ``send_future`` returns, so the server applies it while the engine
    computes, as with the thread.

    A client has one in flight: the next ``send_future`` (or any Step sent) reads this
    one's reply first, so Steps are applied in the order they were sent. A failure of
    the exchange (the connection lost, the deadline) is retried as ``send()`` retries,
    with the same call id: a Step the server applied is answered, not applied again.
    """

    __slots__ = (
        "_client",
        "_error",
        "_finish",
        "_request",
        "_results",
        "_step",
        "_then",
        "_then_error",
        "_then_value",
        "_timeout",
        "finished",
    )

    def __init__(
        self,
        step: SyncStep,
        timeout: float | None,
        then: Callable[[_wire.StepResultList], Any] | None,
    ) -> None:
        client = step._client
        self._client = client
        self._step = step
        self._then = then
        self._timeout = timeout
        self._results: _wire.StepResultList | None = None
        self._error: BaseException | None = None
        self._then_value: Any = None
        self._then_error: BaseException | None = None
        self.finished = False
        request = step.to_pb()
        request.call_id = client._call_id()
        self._request = request
        self._finish: Callable[[], tuple[Any, Any]] | None = None
        try:
            self._finish = client._stub.Step.start(
                request, timeout=timeout or client.options.timeout, metadata=client._metadata
            )
        except grpc.RpcError as exc:
            self._finish = _raising(exc)  # retried (or raised) when the reply is asked for

    def __repr__(self) -> str:
        state = "done" if self.finished else "pending"
        return f"PipelinedStep({len(self._step)} operations, {state})"

    def done(self) -> bool:
        """Whether the reply was read (and ``then`` has run)."""
        return self.finished

    def complete(self) -> None:
        """Read the reply (retrying a failed exchange) and run ``then``; the outcome is
        kept for :meth:`result` and :meth:`then_result`. Runs once."""
        if self.finished:
            return
        client = self._client
        finish, self._finish = self._finish, None
        try:
            response = client._call(
                client._stub.Step,
                self._request,
                self._timeout,
                retry=True,
                codes=RETRYABLE_REPEATS,
                patient=True,
                first=finish,
            )
        except BaseException as exc:  # the caller's to see, from result()
            self._error = exc
        else:
            self._results = self._step.parse(response)
            if self._then is not None:
                try:
                    self._then_value = self._then(self._results)
                except BaseException as exc:  # the caller's to see, from then_result()
                    self._then_error = exc
        finally:
            self.finished = True
            if client._pipelined is self:
                client._pipelined = None

    def result(self) -> _wire.StepResultList:
        """The results, once the server applied the Step (read now if not yet).

        Raises:
            KVCacheError: the call failed (UnavailableError when the server is gone).
        """
        with self._client._pipeline_lock:
            self.complete()
        if self._error is not None:
            raise self._error
        return cast(_wire.StepResultList, self._results)

    def then_result(self) -> Any:
        """What ``send_future``'s ``then`` returned for the results (None without one).

        Raises:
            KVCacheError: the call failed; or whatever ``then`` raised.
        """
        self.result()
        if self._then_error is not None:
            raise self._then_error
        return self._then_value


def _raising(exc: BaseException) -> Callable[[], tuple[Any, Any]]:
    """A pipelined call's first attempt that failed as it was sent: raises when read."""

    def attempt() -> tuple[Any, Any]:
        raise exc

    return attempt


class KVCacheClient:
    """Engine-facing client of one pool.

    Every call has a deadline (``options.timeout``). Calls without side effects (lookup,
    block_table, usage, admin) are retried on UNAVAILABLE. ``allocate``, ``free`` and
    ``step`` are retried on UNAVAILABLE and DEADLINE_EXCEEDED too, up to
    ``options.retries`` times: each carries a call id, and the server answers a repeat of
    a call it applied with that call's reply, so a retry after a lost reply does no work
    twice. While the server answers UNAVAILABLE (a restart: a server on a state directory
    comes back with every request where it was) calls keep being retried for up to
    ``options.unavailable_timeout`` seconds.

    :attr:`epoch` is the pool's state epoch as of the last reply: it stays the same across
    restarts that keep the state; another one means the requests made before are gone.

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
        # How the channel connects, for the hints of errors (unknown for a given channel).
        self._connection = self.options.connection(target) if channel is None else {}
        self._stub = kvcache_pb2_grpc.KVCacheServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._metadata = self.options.metadata()
        self._sender_lock = threading.Lock()
        self._step_sender: StepSender | None = None
        # A framed channel's Step sent by send_future and not read yet (PipelinedStep),
        # and what orders the sending and reading of such Steps across threads.
        self._pipelined: PipelinedStep | None = None
        self._pipeline_lock = threading.Lock()
        framed = isinstance(self._stub.Step, FrameUnaryMethod)
        if self.options.step_sender == "inline" and not framed:
            if self._own_channel:
                self._channel.close()
            raise ValueError(
                f"step_sender='inline' needs a framed target (frames:...), not {target!r}: "
                "a gRPC Step is sent by a thread ('thread')"
            )
        self._inline_steps = framed and self.options.step_sender == "inline"
        self._closed = False
        self._watches: set[Any] = set()  # open WatchEvents streams, cancelled by close()
        # Call ids of Allocate, Free and Step: unique per client, so the server can answer
        # a retried call with its first reply (itertools.count is atomic under the GIL).
        self._call_prefix = uuid.uuid4().hex[:16]
        self._call_numbers = itertools.count(1)
        self.epoch: str | None = None

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
            sender.shutdown()
        # A pipelined Step's reply is read (as the sender thread sends what was queued):
        # its connection then goes back to the channel, which closes it.
        self._settle_pipelined()
        if self._own_channel:
            self._channel.close()

    def _settle_pipelined(self) -> None:
        """Read the reply of a pipelined Step still in flight (before another Step is
        sent, so the server applies them in order)."""
        if self._pipelined is not None:
            with self._pipeline_lock:
                if self._pipelined is not None:
                    self._pipelined.complete()

    def _pipeline(
        self,
        step: SyncStep,
        timeout: float | None,
        then: Callable[[_wire.StepResultList], Any] | None,
    ) -> PipelinedStep:
        """Send ``step`` on this framed client's socket now (after reading the reply of
        the one sent before: Steps are applied in the order sent)."""
        with self._pipeline_lock:
            if self._pipelined is not None:
                self._pipelined.complete()
            pipelined = self._pipelined = PipelinedStep(step, timeout, then)
        return pipelined

    def _sender(self) -> StepSender:
        """The one thread that sends this client's ``send_future`` Steps (made on first use)."""
        sender = self._step_sender
        if sender is not None:
            return sender
        with self._sender_lock:
            if self._step_sender is None:
                self._step_sender = StepSender("kvsvc-step")
            return self._step_sender

    def __enter__(self) -> KVCacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call_id(self) -> str:
        return f"{self._call_prefix}-{next(self._call_numbers)}"

    def _call(
        self,
        method: Any,
        request: Any,
        timeout: float | None,
        retry: bool,
        codes: frozenset[grpc.StatusCode] = RETRYABLE,
        patient: bool = False,
        first: Callable[[], tuple[Any, Any]] | None = None,
    ) -> Any:
        """One RPC; with ``retry``, up to ``options.retries`` more after a status in
        ``codes``, and (``patient``: Allocate, Free, Step) more while the server answers
        UNAVAILABLE (a restart), for up to ``options.unavailable_timeout`` seconds; backing
        off between attempts. Notes the pool's epoch from the reply. ``first``: the first
        attempt, already sent (a pipelined Step's reply, read when called)."""
        options = self.options
        patience = time.monotonic() + (options.unavailable_timeout if patient else 0.0)
        attempt = 0
        while True:
            try:
                if first is not None:
                    attempt_now, first = first, None
                    response, call = attempt_now()
                else:
                    response, call = method.with_call(
                        request, timeout=timeout or options.timeout, metadata=self._metadata
                    )
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                attempt += 1
                wait = options.retry_delay(code, attempt, retry, codes, patience)
                if wait is not None:
                    time.sleep(wait)
                    continue
                raise error_from_rpc(exc, **self._connection) from None
            self._note_epoch(call)
            return response

    def _note_epoch(self, call: Any) -> None:
        """Keep the pool's state epoch from a reply's trailing metadata (see
        :attr:`epoch`)."""
        self.epoch = epoch_of_reply(call.trailing_metadata(), self.pool, self.epoch)

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

        Retried after UNAVAILABLE or DEADLINE_EXCEEDED (see the class): if the lost
        attempt was applied, the retry answers its reply (same blocks, counts).
        ``result.needs_recompute``: the request's KV data is gone; free it as preempted and
        admit it again.
        """
        request = _wire.allocate_request(
            self.pool, request_id, new_token_ids, num_new_tokens, num_lookahead_tokens, start
        )
        request.call_id = self._call_id()
        return _wire.allocate_result(
            self._call(
                self._stub.Allocate,
                request,
                timeout,
                retry=True,
                codes=RETRYABLE_REPEATS,
                patient=True,
            )
        )

    def free(self, *request_ids: str, preempted: bool = False, timeout: float | None = None) -> int:
        """Release requests; returns blocks whose last holder this was.

        Retried after UNAVAILABLE or DEADLINE_EXCEEDED (see the class): a retry of an
        attempt the server applied answers that attempt's count (by the call's id; ids
        freed before that call are recently freed ones: they succeed with 0 blocks).
        """
        request = _wire.free_request(self.pool, request_ids, preempted)
        request.call_id = self._call_id()
        response = self._call(
            self._stub.Free, request, timeout, retry=True, codes=RETRYABLE_REPEATS, patient=True
        )
        return response.num_freed_blocks

    def free_needing_recompute(self, *, timeout: float | None = None) -> int:
        """Free every live request of this client's engine whose KV data is gone (those
        that answer RECOMPUTE); returns how many were freed.

        For an engine that starts again after its predecessor died with requests live: a
        new agent process took the rank (fresh tensors), so those requests have nothing
        left to resume, and the pool would otherwise hold their blocks. An engine that
        lives on frees its own flagged requests as preempted and admits them again.
        """
        request = kvcache_pb2.FreeRequest(
            pool=self.pool, needing_recompute=True, call_id=self._call_id()
        )
        response = self._call(
            self._stub.Free, request, timeout, retry=True, codes=RETRYABLE_REPEATS, patient=True
        )
        return response.num_freed_requests

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
        if from_sequence is not None and not 0 <= from_sequence < 2**64:
            raise ValueError(f"from_sequence must be in [0, 2^64), got {from_sequence}")
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
                try:
                    stream = self._stub.WatchEvents(request, metadata=self._metadata)
                except grpc.RpcError as exc:  # a channel that refuses at once (frames:)
                    raise error_from_rpc(exc, **self._connection) from None
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
                    raise error_from_rpc(exc, **self._connection) from None
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

    def force_reset_prefix_cache(self, *, timeout: float | None = None) -> tuple[int, int]:
        """Operator: drop every cached hash of the pool now, even while requests hold
        blocks (``reset_prefix_cache`` refuses then). The pool's live requests are flagged:
        their next allocation answers RECOMPUTE. Not retried (a repeat would flag the
        requests admitted meanwhile).

        Returns:
            The requests flagged and the cached blocks dropped.
        """
        request = admin_pb2.ForceResetPrefixCacheRequest(pool=self.pool)
        response = self._call(self._admin.ForceResetPrefixCache, request, timeout, retry=False)
        return response.num_requests_flagged, response.num_cached_blocks_dropped

    def snapshot(self, out: str | os.PathLike[str], *, timeout: float | None = None) -> int:
        """Operator: write the pool's whole state to the new file ``out`` (mode 0600: it
        holds the pool's hash seed), for ``kvsvc serve --restore``. Returns its size.

        Raises:
            FileExistsError: ``out`` exists.
            KVCacheError: the call failed (nothing is left at ``out``).
        """
        path = Path(out)
        partial = path.with_name(path.name + ".partial")
        request = admin_pb2.SnapshotPoolRequest(pool=self.pool)
        if path.exists():
            raise FileExistsError(f"{path} exists; choose another --out")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        written = 0
        try:
            with os.fdopen(fd, "wb") as handle:
                for chunk in self._admin.SnapshotPool(
                    request,
                    timeout=timeout or max(60.0, self.options.timeout),
                    metadata=self._metadata,
                ):
                    handle.write(chunk.data)
                    written += len(chunk.data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, path)
        except grpc.RpcError as exc:
            partial.unlink(missing_ok=True)
            raise error_from_rpc(exc, **self._connection) from None
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return written

    def wait_until_ready(
        self, timeout: float = 60.0, poll: float = 0.1, *, stop_on_plan_error: bool = False
    ) -> PoolInfo:
        """Poll the admin view until the pool is READY (or DEGRADED); raise on timeout.

        A server that is not up yet is waited for; what waiting cannot fix raises at once:
        a token the server refuses, or a server that has no such pool. With
        ``stop_on_plan_error`` a failed planning does too (the agents have been told, and
        only new registrations, after whatever the error says to change, plan again).

        Raises:
            TimeoutError: not ready in time; the message has the last state seen (ranks
                registered, the planning error) or why the server was unreachable.
            UnauthenticatedError / PermissionDeniedError: the token.
            NotFoundError: the server has no pool of this name (the message lists its pools).
            NotReadyError: ``stop_on_plan_error`` and the pool's planning failed (the
                message has the server's error).
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
                if stop_on_plan_error and info.error and info.state == "WAITING_FOR_WORKERS":
                    raise NotReadyError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"pool {self.pool!r} failed to plan: {info.error}",
                    )
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
