"""The asyncio engine client (same API as :class:`kvsvc_client.KVCacheClient`, awaitable)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

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
from kvsvc_client.errors import error_from_rpc

_T = TypeVar("_T")


class AsyncStep(_wire.StepBuilder):
    def __init__(self, client: AsyncKVCacheClient) -> None:
        super().__init__(client.pool)
        self._client = client

    async def send(self, timeout: float | None = None) -> _wire.StepResultList:
        """Apply the operations in order; one result per operation (never retried)."""
        response = await self._client._call(
            self._client._stub.Step, self.to_pb(), timeout, retry=False
        )
        return self.parse(response)


class AsyncKVCacheClient:
    """Engine-facing asyncio client of one pool. See :class:`kvsvc_client.KVCacheClient`.

    Retries as that client does: side-effect-free calls after UNAVAILABLE; admissions and
    ``free`` after UNAVAILABLE or DEADLINE_EXCEEDED too (the server makes repeating them
    safe); later ``allocate`` calls and ``step`` never.
    """

    def __init__(self, target: str, pool: str, *, options: ClientOptions | None = None) -> None:
        self.pool = pool
        self.target = target
        self.options = options or ClientOptions()
        self._channel = self.options.aio_channel(target)
        self._stub = kvcache_pb2_grpc.KVCacheServiceStub(self._channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._metadata = self.options.metadata()

    def __repr__(self) -> str:
        return f"AsyncKVCacheClient({self.target!r}, pool={self.pool!r})"

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: Callable[..., Awaitable[_T]],
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
                return await method(
                    request, timeout=timeout or self.options.timeout, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                if attempt + 1 < attempts and exc.code() in codes:
                    await asyncio.sleep(self.options.delay(attempt))
                    continue
                raise error_from_rpc(exc) from None
        raise AssertionError("unreachable")

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
        """See :meth:`kvsvc_client.KVCacheClient.allocate` (admissions are retried)."""
        request = _wire.allocate_request(
            self.pool, request_id, new_token_ids, num_new_tokens, num_lookahead_tokens, start
        )
        admission = request.HasField("start")
        return _wire.allocate_result(
            await self._call(
                self._stub.Allocate, request, timeout, retry=admission, codes=RETRYABLE_REPEATS
            )
        )

    async def free(
        self, *request_ids: str, preempted: bool = False, timeout: float | None = None
    ) -> int:
        """See :meth:`kvsvc_client.KVCacheClient.free` (retried: a repeat is safe)."""
        request = _wire.free_request(self.pool, request_ids, preempted)
        response = await self._call(
            self._stub.Free, request, timeout, retry=True, codes=RETRYABLE_REPEATS
        )
        return response.num_freed_blocks

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
                    raise error_from_rpc(exc) from None
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
