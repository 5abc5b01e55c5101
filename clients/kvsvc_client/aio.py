"""The asyncio engine client (same API as :class:`kvsvc_client.KVCacheClient`, awaitable)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvsvc.v1 import admin_pb2, admin_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc
from kvsvc_client import _wire
from kvsvc_client._common import (
    RETRYABLE,
    RETRYABLE_REPEATS,
    ClientOptions,
    epoch_of_reply,
)
from kvsvc_client._types import (
    AllocateResult,
    BlockTable,
    EventBatch,
    HashingContext,
    PoolInfo,
    RequestStart,
    Usage,
)
from kvsvc_client.errors import error_from_rpc

_log = logging.getLogger("kvsvc_client")


class AsyncStep(_wire.StepBuilder):
    def __init__(self, client: AsyncKVCacheClient) -> None:
        super().__init__(client.pool)
        self._client = client

    async def send(self, timeout: float | None = None) -> _wire.StepResultList:
        """Apply the operations in order; one result per operation (retried like
        :meth:`kvsvc_client.SyncStep.send`: the Step carries a call id)."""
        client = self._client
        request = self.to_pb()
        request.call_id = client._call_id()
        response = await client._call(
            client._stub.Step, request, timeout, retry=True, codes=RETRYABLE_REPEATS, patient=True
        )
        return self.parse(response)


class AsyncKVCacheClient:
    """Engine-facing asyncio client of one pool. See :class:`kvsvc_client.KVCacheClient`.

    Retries as that client does: side-effect-free calls after UNAVAILABLE; ``allocate``,
    ``free`` and ``step`` after UNAVAILABLE or DEADLINE_EXCEEDED too (each carries a call
    id: the server answers a repeat of an applied call with its reply); and every call
    while the server is UNAVAILABLE for up to ``options.unavailable_timeout`` seconds.
    :attr:`epoch` is the pool's state epoch as of the last reply.
    """

    def __init__(self, target: str, pool: str, *, options: ClientOptions | None = None) -> None:
        self.pool = pool
        self.target = target
        self.options = options or ClientOptions()
        self._channel = self.options.aio_channel(target)
        # How the channel connects, for the hints of errors.
        self._connection = self.options.connection(target)
        self._stub = kvcache_pb2_grpc.KVCacheServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._metadata = self.options.metadata()
        self._call_prefix = uuid.uuid4().hex[:16]
        self._call_numbers = itertools.count(1)
        self.epoch: str | None = None

    def __repr__(self) -> str:
        return f"AsyncKVCacheClient({self.target!r}, pool={self.pool!r})"

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _call_id(self) -> str:
        return f"{self._call_prefix}-{next(self._call_numbers)}"

    async def _call(
        self,
        method: Any,
        request: Any,
        timeout: float | None,
        retry: bool,
        codes: frozenset[grpc.StatusCode] = RETRYABLE,
        patient: bool = False,
    ) -> Any:
        """One RPC, retried as :meth:`kvsvc_client.KVCacheClient._call` does; notes the
        pool's epoch from the reply."""
        options = self.options
        patience = time.monotonic() + (options.unavailable_timeout if patient else 0.0)
        attempt = 0
        while True:
            call = method(request, timeout=timeout or options.timeout, metadata=self._metadata)
            try:
                response = await call
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                attempt += 1
                wait = options.retry_delay(code, attempt, retry, codes, patience)
                if wait is not None:
                    await asyncio.sleep(wait)
                    continue
                raise error_from_rpc(exc, **self._connection) from None
            trailing = getattr(call, "trailing_metadata", None)
            if trailing is not None:
                self._note_epoch(await trailing())
            return response

    def _note_epoch(self, metadata: Any) -> None:
        self.epoch = epoch_of_reply(metadata, self.pool, self.epoch)

    async def allocate(
        self,
        request_id: str,
        new_token_ids: Sequence[int] = (),
        num_new_tokens: int = 0,
        *,
        num_lookahead_tokens: int = 0,
        start: RequestStart | bool = False,
        timeout: float | None = None,
    ) -> AllocateResult:
        """See :meth:`kvsvc_client.KVCacheClient.allocate` (retried: a repeat is safe)."""
        request = _wire.allocate_request(
            self.pool, request_id, new_token_ids, num_new_tokens, num_lookahead_tokens, start
        )
        request.call_id = self._call_id()
        return _wire.allocate_result(
            await self._call(
                self._stub.Allocate,
                request,
                timeout,
                retry=True,
                codes=RETRYABLE_REPEATS,
                patient=True,
            )
        )

    async def free(
        self, *request_ids: str, preempted: bool = False, timeout: float | None = None
    ) -> int:
        """See :meth:`kvsvc_client.KVCacheClient.free` (retried: a repeat is safe)."""
        request = _wire.free_request(self.pool, request_ids, preempted)
        request.call_id = self._call_id()
        response = await self._call(
            self._stub.Free, request, timeout, retry=True, codes=RETRYABLE_REPEATS, patient=True
        )
        return response.num_freed_blocks

    async def free_needing_recompute(self, *, timeout: float | None = None) -> int:
        """See :meth:`kvsvc_client.KVCacheClient.free_needing_recompute` (retried)."""
        request = kvcache_pb2.FreeRequest(
            pool=self.pool, needing_recompute=True, call_id=self._call_id()
        )
        response = await self._call(
            self._stub.Free, request, timeout, retry=True, codes=RETRYABLE_REPEATS, patient=True
        )
        return response.num_freed_requests

    def step(self) -> AsyncStep:
        return AsyncStep(self)

    async def lookup(
        self,
        token_ids: Sequence[int],
        hashing: HashingContext | None = None,
        *,
        timeout: float | None = None,
    ) -> int:
        request = _wire.lookup_request(self.pool, token_ids, hashing)
        return (await self._call(self._stub.Lookup, request, timeout, retry=True)).num_cached_tokens

    async def block_table(self, request_id: str, *, timeout: float | None = None) -> BlockTable:
        request = kvcache_pb2.GetBlockTableRequest(pool=self.pool, request_id=request_id)
        return _wire.block_table(
            await self._call(self._stub.GetBlockTable, request, timeout, retry=True)
        )

    async def usage(self, *, timeout: float | None = None) -> Usage:
        request = kvcache_pb2.GetUsageRequest(pool=self.pool)
        return _wire.usage(await self._call(self._stub.GetUsage, request, timeout, retry=True))

    async def reset_prefix_cache(self, *, timeout: float | None = None) -> bool:
        request = kvcache_pb2.ResetPrefixCacheRequest(pool=self.pool)
        return (await self._call(self._stub.ResetPrefixCache, request, timeout, retry=True)).reset

    async def watch_events(
        self,
        from_sequence: int | None = None,
        *,
        reconnect: bool = True,
        epoch: str = "",
        caught_up: bool = False,
    ) -> AsyncIterator[EventBatch]:
        """Follow the pool's events; resumes after the last batch after a reconnect.
        ``caught_up=True`` also yields the caught-up marker after each replay (see the
        sync client's ``watch_events``)."""
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
            call = self._stub.WatchEvents(request, metadata=self._metadata)
            try:
                async for message in call:
                    attempt = 0
                    batch = _wire.event_batch(message)
                    epoch = batch.epoch or epoch
                    next_seq = _wire.resume_sequence(batch)
                    yield batch
                return
            except grpc.aio.AioRpcError as exc:
                if not reconnect or exc.code() not in RETRYABLE:
                    raise error_from_rpc(exc, **self._connection) from None
                await asyncio.sleep(self.options.delay(attempt))
                attempt += 1
            finally:
                call.cancel()

    async def list_pools(self, *, timeout: float | None = None) -> list[PoolInfo]:
        response = await self._call(
            self._admin.ListPools, admin_pb2.ListPoolsRequest(), timeout, retry=True
        )
        return [_wire.pool_info(p) for p in response.pools]

    async def get_plan(
        self, pool: str | None = None, *, timeout: float | None = None
    ) -> admin_pb2.GetPlanResponse:
        request = admin_pb2.GetPlanRequest(pool=pool or self.pool)
        return await self._call(self._admin.GetPlan, request, timeout, retry=True)
