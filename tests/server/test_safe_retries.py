"""Safe retries (issue 9): an admission or a Free whose reply was lost can be sent again.

A client whose deadline ran out had its 4,000 admissions applied, and its retry got
"already live". Now:

* a repeated admission (same id, prompt, start and counts) before the request's next call
  answers the request's current state (OK, all its blocks, its cached and computed
  counts); anything else for a live id is ALREADY_EXISTS;
* a Free of a recently freed id succeeds with 0 blocks (a never-seen id stays NOT_FOUND);
* the typed clients retry Allocate, Free and Step after UNAVAILABLE or DEADLINE_EXCEEDED
  (issue 10): each carries a call id, and the server answers a repeat of an applied call
  with its first reply, so continuations and Steps are applied exactly once too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from kvsvc_client import (
    AlreadyExistsError,
    AsyncKVCacheClient,
    ClientOptions,
    HashingContext,
    KVCacheClient,
    NotFoundError,
    OperationError,
    RequestStart,
    UnavailableError,
)

from kvsvc.server.config import PoolConfig
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import ServerThread, bring_up, running_server

# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16
OPTIONS = ClientOptions(backoff=0.001, max_backoff=0.002, unavailable_timeout=0.0)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(PoolConfig(name="p", max_model_len=512)) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=129 * BYTES_PER_BLOCK)
        yield srv
        for rank in ranks:
            rank.close()


@pytest.fixture()
def kv(server: ServerThread) -> Iterator[KVCacheClient]:
    with KVCacheClient(server.address, pool="p", options=OPTIONS) as client:
        yield client
        for rid in server.run(lambda: server.server.pools.by_name["p"].cache.request_ids()):
            client.free(rid)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def state(kv: KVCacheClient) -> tuple[Any, ...]:
    usage = kv.usage()
    return usage.num_free_blocks, usage.num_requests, usage.num_cached_blocks


# -- the server --------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [10, 40], ids=["repeated", "packed"])
def test_a_repeated_admission_returns_the_same_blocks(kv: KVCacheClient, length: int) -> None:
    """Regression: the retry of an applied admission got an error ("already live")."""
    assert kv.allocate("warm", tokens(0, 48), 48, start=True).ok
    prompt = [*tokens(0, 32), *tokens(1000, length)]
    start = RequestStart(hashing=HashingContext(cache_salt=""))
    first = kv.allocate("r", prompt, 100, start=start)
    assert first.ok and first.num_cached_tokens == 32
    before = state(kv)
    again = kv.allocate("r", prompt, 100, start=start)
    assert again == first
    assert state(kv) == before
    table = kv.block_table("r")
    assert list(again.new_block_ids[0]) == list(table.groups[0])
    assert again.num_computed_tokens == table.num_computed_tokens == len(prompt)


def test_a_different_admission_of_a_live_id_is_already_exists(kv: KVCacheClient) -> None:
    prompt = tokens(0, 20)
    assert kv.allocate("r", prompt, 20, start=True).ok
    before = state(kv)
    for call in (
        lambda: kv.allocate("r", tokens(1, 20), 20, start=True),
        lambda: kv.allocate("r", prompt, 19, start=True),
        lambda: kv.allocate("r", prompt, 20, start=RequestStart(resumed=True)),
        lambda: kv.allocate(
            "r", prompt, 20, start=RequestStart(hashing=HashingContext(cache_salt="t"))
        ),
    ):
        with pytest.raises(AlreadyExistsError, match="already live"):
            call()
        assert state(kv) == before


def test_after_a_continuation_a_repeated_admission_is_already_exists(kv: KVCacheClient) -> None:
    prompt = tokens(0, 20)
    assert kv.allocate("unary", prompt, 20, start=True).ok
    assert kv.allocate("stepped", prompt, 20, start=True).ok
    assert kv.allocate("unary", [1], 1).ok
    (decode,) = kv.step().allocate("stepped", [1], 1).send()  # the Step fast path
    assert not isinstance(decode, OperationError) and decode.ok
    before = state(kv)
    for rid in ("unary", "stepped"):
        with pytest.raises(AlreadyExistsError, match="called since its admission"):
            kv.allocate(rid, prompt, 20, start=True)
    assert state(kv) == before


def test_step_admissions_are_retried_per_operation(kv: KVCacheClient) -> None:
    def batch() -> Any:
        step = kv.step()
        step.allocate("s1", tokens(0, 20), 20, start=True)
        step.allocate("s2", tokens(500, 20), 20, start=True)
        return step.send()

    first = batch()
    before = state(kv)
    again = batch()
    assert list(again) == list(first)
    assert state(kv) == before
    (after,) = kv.step().allocate("s1", [3], 1).send()
    assert not isinstance(after, OperationError)
    s1, s2 = batch()
    assert isinstance(s1, OperationError) and s1.code == grpc.StatusCode.ALREADY_EXISTS
    assert s2 == first[1]


def test_a_repeated_free_succeeds_with_nothing_freed(kv: KVCacheClient) -> None:
    assert kv.allocate("f", tokens(0, 40), 40, start=True).ok
    assert kv.free("f") == 3
    before = state(kv)
    assert kv.free("f") == 0
    (again,) = kv.step().free("f").send()
    assert not isinstance(again, OperationError) and again.num_freed_blocks == 0
    assert state(kv) == before
    with pytest.raises(NotFoundError):
        kv.free("never-seen")
    (unknown,) = kv.step().free("never-seen").send()
    assert isinstance(unknown, OperationError) and unknown.code == grpc.StatusCode.NOT_FOUND


# -- the typed clients ---------------------------------------------------------------------------


class _LostReply(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"simulated {self._code.name}"


class _LoseReplies(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """For the first ``count`` calls of ``method``: send it and let the server apply it,
    then drop the reply and fail with ``code``, as a deadline or a broken connection after
    the server applied the call does (``applied=False``: fail before sending)."""

    def __init__(
        self, method: str, code: grpc.StatusCode, count: int = 1, applied: bool = True
    ) -> None:
        self.method = method
        self.code = code
        self.count = count
        self.applied = applied
        self.sent: list[str] = []

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        if not details.method.endswith(f"/{self.method}"):
            return continuation(details, request)
        self.sent.append(details.method)
        if self.count <= 0:
            return continuation(details, request)
        self.count -= 1
        if self.applied:
            continuation(details, request).result()  # applied on the server
        raise _LostReply(self.code)


def lossy_client(server: ServerThread, interceptor: _LoseReplies) -> KVCacheClient:
    channel = grpc.intercept_channel(grpc.insecure_channel(server.address), interceptor)
    return KVCacheClient(server.address, pool="p", options=OPTIONS, channel=channel)


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE], ids=str
)
def test_the_client_retries_an_admission_whose_reply_was_lost(
    server: ServerThread, kv: KVCacheClient, code: grpc.StatusCode
) -> None:
    lossy = _LoseReplies("Allocate", code)
    with lossy_client(server, lossy) as client:
        result = client.allocate("lost", tokens(0, 40), 40, start=True)
    assert len(lossy.sent) == 2  # applied once, answered by the retry
    assert result.ok and result.num_computed_tokens == 40
    assert list(result.new_block_ids[0]) == list(kv.block_table("lost").groups[0])
    assert kv.usage().num_requests == 1


def test_the_client_retries_a_free_whose_reply_was_lost(
    server: ServerThread, kv: KVCacheClient
) -> None:
    assert kv.allocate("lost", tokens(0, 40), 40, start=True).ok
    lossy = _LoseReplies("Free", grpc.StatusCode.DEADLINE_EXCEEDED)
    with lossy_client(server, lossy) as client:
        # The lost attempt freed the 3 blocks; the retry (same call id) answers its reply.
        assert client.free("lost") == 3
    assert len(lossy.sent) == 2
    assert kv.usage().num_requests == 0


def test_the_client_retries_continuations_and_steps_applying_them_once(
    server: ServerThread, kv: KVCacheClient
) -> None:
    assert kv.allocate("c", tokens(0, 20), 20, start=True).ok
    lossy = _LoseReplies("Allocate", grpc.StatusCode.DEADLINE_EXCEEDED)
    with lossy_client(server, lossy) as client:
        result = client.allocate("c", [1], 1)
        assert len(lossy.sent) == 2
        assert result.ok and result.num_computed_tokens == 21  # the first attempt's reply
        assert kv.block_table("c").num_computed_tokens == 21  # applied exactly once
        step_lossy = _LoseReplies("Step", grpc.StatusCode.UNAVAILABLE)
    with lossy_client(server, step_lossy) as client:
        results = client.step().allocate("c", [2], 1).allocate("c", [3], 1).send()
    assert len(step_lossy.sent) == 2
    assert [r.num_computed_tokens for r in results] == [22, 23]
    assert kv.block_table("c").num_computed_tokens == 23
    assert kv.block_table("c").num_tokens == 23  # each token appended once


def test_a_call_id_names_one_call() -> None:
    """A repeat with the call id answers the same reply; the same id on another kind of
    call is refused (a client bug, not a retry)."""
    with running_server(PoolConfig(name="q", world_size=1, max_model_len=256)) as srv:
        bring_up(srv, "q", kv_cache_bytes=BYTES_PER_BLOCK * 40)
        channel = grpc.insecure_channel(srv.address)
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        admit = kvcache_pb2.AllocateRequest(
            pool="q", request_id="a", new_token_ids=tokens(0, 16), num_new_tokens=16,
            call_id="same",
        )  # fmt: skip
        admit.start.SetInParent()
        first = stub.Allocate(admit, timeout=10)
        assert stub.Allocate(admit, timeout=10) == first
        with pytest.raises(grpc.RpcError) as refused:
            stub.Free(kvcache_pb2.FreeRequest(pool="q", request_ids=["a"], call_id="same"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "call_id" in (refused.value.details() or "")
        channel.close()


def test_the_client_gives_up_after_options_retries(server: ServerThread) -> None:
    lossy = _LoseReplies("Free", grpc.StatusCode.UNAVAILABLE, count=10, applied=False)
    with lossy_client(server, lossy) as client, pytest.raises(UnavailableError):
        client.free("whatever")
    assert len(lossy.sent) == 1 + OPTIONS.retries


class _LossyAioStub:
    """The asyncio client's stub with the first reply of ``method`` lost after the call."""

    def __init__(self, stub: Any, method: str, code: grpc.StatusCode) -> None:
        self._stub = stub
        self._method = method
        self._code = code
        self.sent = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._stub, name)
        if name != self._method:
            return real

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.sent += 1
            response = await real(*args, **kwargs)
            if self.sent == 1:
                raise grpc.aio.AioRpcError(
                    self._code, grpc.aio.Metadata(), grpc.aio.Metadata(), "simulated"
                )
            return response

        return call


def test_the_async_client_retries_admissions_and_frees(
    server: ServerThread, kv: KVCacheClient
) -> None:
    async def scenario() -> tuple[Any, int, int, int]:
        async with AsyncKVCacheClient(server.address, pool="p", options=OPTIONS) as client:
            stub = client._stub
            client._stub = lossy = _LossyAioStub(stub, "Allocate", grpc.StatusCode.UNAVAILABLE)
            result = await client.allocate("aio", tokens(0, 40), 40, start=True)
            sent_allocate = lossy.sent
            client._stub = lossy = _LossyAioStub(stub, "Free", grpc.StatusCode.DEADLINE_EXCEEDED)
            freed = await client.free("aio")
            return result, sent_allocate, lossy.sent, freed

    result, sent_allocate, sent_free, freed = asyncio.run(scenario())
    assert result.ok and result.num_computed_tokens == 40
    # The free's retry answers the lost attempt's reply (3 blocks freed), by its call id.
    assert (sent_allocate, sent_free, freed) == (2, 2, 3)
    assert kv.usage().num_requests == 0


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE], ids=str
)
def test_the_async_client_retries_a_step_applying_it_once(
    server: ServerThread, kv: KVCacheClient, code: grpc.StatusCode
) -> None:
    """As the sync client's case: the Step's first reply is lost after the server applied
    it; the retry carries the same call id, so it is answered, not applied again."""
    assert kv.allocate("aio-step", tokens(0, 20), 20, start=True).ok

    async def scenario() -> tuple[Any, int]:
        async with AsyncKVCacheClient(server.address, pool="p", options=OPTIONS) as client:
            client._stub = lossy = _LossyAioStub(client._stub, "Step", code)
            results = (
                await client.step().allocate("aio-step", [2], 1).allocate("aio-step", [3], 1).send()
            )
            return results, lossy.sent

    results, sent = asyncio.run(scenario())
    assert sent == 2
    assert [r.num_computed_tokens for r in results] == [21, 22]  # the first attempt's reply
    table = kv.block_table("aio-step")
    assert (table.num_computed_tokens, table.num_tokens) == (22, 22)  # applied once
