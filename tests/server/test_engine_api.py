"""The engine-facing API over real gRPC on loopback: semantics, errors, Step, events."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from kvsvc_client import (
    AllocateStatus,
    AlreadyExistsError,
    BlockStored,
    ClientOptions,
    FreeResult,
    HashingContext,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    NotReadyError,
    OperationError,
    RequestStart,
    UnauthenticatedError,
)

from kvsvc.server.config import PoolConfig
from tests.server.harness import ServerThread, bring_up, running_server

BLOCK = 16
# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * BLOCK
USABLE_BLOCKS = 20


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pool = PoolConfig(name="p", world_size=1, max_model_len=256)
    tiny = PoolConfig(name="tiny", world_size=1, max_model_len=64, num_gpu_blocks_override=5)
    waiting = PoolConfig(name="waiting", world_size=2, max_model_len=256)
    with running_server(pool, tiny, waiting, event_buffer_batches=50) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=(USABLE_BLOCKS + 1) * BYTES_PER_BLOCK)
        ranks += bring_up(srv, "tiny", kv_cache_bytes=(USABLE_BLOCKS + 1) * BYTES_PER_BLOCK)
        yield srv
        for rank in ranks:
            rank.close()


@pytest.fixture
def kv(server: ServerThread) -> Iterator[KVCacheClient]:
    with KVCacheClient(server.address, pool="p") as client:
        yield client
        # Leave the pool empty for the next test.
        table = server.run(lambda: list(server.server.pools.get("p").cache.request_ids()))
        if table:
            client.free(*table)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_first_allocate_reports_cached_prefix_and_shares_blocks(kv: KVCacheClient) -> None:
    first = kv.allocate("a", tokens(1000, 40), num_new_tokens=512, start=True)
    assert first.status is AllocateStatus.OK
    assert first.num_cached_tokens == 0
    assert first.num_scheduled_tokens == 40
    assert first.num_computed_tokens == 40
    assert [len(g) for g in first.new_block_ids] == [3]

    # Same first 32 tokens (two full blocks), different tail.
    second = kv.allocate("b", tokens(1000, 32) + tokens(5000, 9), num_new_tokens=512, start=True)
    assert second.num_cached_tokens == 32
    assert second.num_scheduled_tokens == 9
    assert second.new_block_ids[0][:2] == first.new_block_ids[0][:2]  # shared prefix blocks
    assert second.new_block_ids[0][2] != first.new_block_ids[0][2]

    table = kv.block_table("b")
    assert table.groups == (second.new_block_ids[0],)
    assert table.num_computed_tokens == 41
    assert table.num_tokens == 41
    kv.free("a", "b")


def test_lookup_has_no_side_effects(kv: KVCacheClient) -> None:
    kv.allocate("a", tokens(2000, 48), num_new_tokens=48, start=True)
    kv.free("a")
    before = kv.usage()
    # What an admission would reuse: all three blocks are cached, but one token must be
    # computed, so a 48-token prompt reuses two blocks and a 49-token one all three.
    assert kv.lookup(tokens(2000, 48)) == 32
    assert kv.lookup([*tokens(2000, 48), 1]) == 48
    assert kv.lookup(tokens(2000, 40)) == 32
    assert kv.lookup([7, 8, 9]) == 0
    after = kv.usage()
    assert (after.num_free_blocks, after.prefix_cache_queries) == (
        before.num_free_blocks,
        before.prefix_cache_queries,
    )


def test_hit_is_capped_so_one_token_is_recomputed(kv: KVCacheClient) -> None:
    kv.allocate("a", tokens(3000, 32), num_new_tokens=32, start=True)
    kv.free("a")
    again = kv.allocate("a2", tokens(3000, 32), num_new_tokens=32, start=True)
    # Both blocks are cached, but the last token must be computed: one block is reused.
    assert again.num_cached_tokens == 16
    assert again.num_scheduled_tokens == 16


def test_cache_salt_isolates_prefixes(kv: KVCacheClient) -> None:
    salted = RequestStart(hashing=HashingContext(cache_salt="tenant-a"))
    kv.allocate("a", tokens(4000, 33), num_new_tokens=33, start=salted)
    other = kv.allocate("b", tokens(4000, 33), num_new_tokens=33, start=True)
    same = kv.allocate(
        "c",
        tokens(4000, 33),
        num_new_tokens=33,
        start=RequestStart(hashing=HashingContext(cache_salt="tenant-a")),
    )
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 32


def test_decode_appends_and_allocates_at_block_boundaries(kv: KVCacheClient) -> None:
    first = kv.allocate("a", tokens(6000, 15), num_new_tokens=15, start=True)
    assert [len(g) for g in first.new_block_ids] == [1]
    step1 = kv.allocate("a", [1], num_new_tokens=1)  # token 16 fills block 0
    assert step1.new_block_ids == ((),)
    step2 = kv.allocate("a", [2], num_new_tokens=1)  # token 17 needs block 1
    assert [len(g) for g in step2.new_block_ids] == [1]
    assert step2.num_computed_tokens == 17
    # The completed block (15 prompt tokens + sampled token 1) is now cached.
    assert kv.lookup([*tokens(6000, 15), 1, 99]) == 16


def test_no_space_changes_nothing_and_succeeds_after_free(kv: KVCacheClient) -> None:
    # 10 + 8 of the 20 usable blocks are taken: a 3-block prompt does not fit.
    assert kv.allocate("big", tokens(7000, 160), num_new_tokens=160, start=True).ok
    assert kv.allocate("big2", tokens(17000, 128), num_new_tokens=128, start=True).ok
    before = kv.usage()
    assert before.num_free_blocks == 2
    denied = kv.allocate("x", tokens(8000, 16 * 3), num_new_tokens=48, start=True)
    assert denied.status is AllocateStatus.NO_SPACE
    assert denied.num_scheduled_tokens == 0
    after = kv.usage()
    assert (after.num_free_blocks, after.num_requests) == (
        before.num_free_blocks,
        before.num_requests,
    )
    with pytest.raises(NotFoundError):
        kv.block_table("x")  # the denied request was not admitted
    kv.free("big", "big2")
    retry = kv.allocate("x", tokens(8000, 16 * 3), num_new_tokens=48, start=True)
    assert retry.ok and retry.num_scheduled_tokens == 48


def test_step_applies_operations_in_order(kv: KVCacheClient) -> None:
    step = kv.step()
    step.allocate("s1", tokens(9000, 20), 20, start=True)
    step.allocate("s2", tokens(9000, 20), 20, start=True)
    step.allocate("nope", [1], 1)  # unknown request: rejected alone
    step.allocate("s1", [5], 1)  # decode right after admission, same step
    step.free("s2")
    step.allocate("s2", tokens(9000, 20), 20, start=RequestStart(resumed=True))
    results = step.send()
    assert len(results) == 6
    s1, s2, nope, s1_decode, s2_free, s2_again = results
    assert isinstance(s1, type(s2)) and s1.ok and s2.ok
    assert s2.num_cached_tokens == 16  # s1's first block was cached by the time s2 ran
    assert isinstance(nope, OperationError) and nope.code == grpc.StatusCode.NOT_FOUND
    assert not isinstance(s1_decode, OperationError) and s1_decode.num_computed_tokens == 21
    assert isinstance(s2_free, FreeResult)
    assert not isinstance(s2_again, OperationError) and s2_again.ok
    assert kv.block_table("s2").num_computed_tokens == 20


def test_step_with_mismatched_columns_is_rejected_whole(
    kv: KVCacheClient, server: ServerThread
) -> None:
    from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc

    before = kv.usage()
    stub = kvcache_pb2_grpc.KVCacheServiceStub(grpc.insecure_channel(server.address))
    request = kvcache_pb2.StepRequest(
        pool="p",
        types=[kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE] * 2,
        request_ids=["a"],
        num_new_tokens=[1, 1],
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_ids" in err.value.details()
    assert kv.usage().num_free_blocks == before.num_free_blocks


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda kv: kv.allocate("e", [1, 2], num_new_tokens=-1, start=True), "num_new_tokens"),
        (lambda kv: kv.allocate("e", [1, 2**31], num_new_tokens=2, start=True), "new_token_ids"),
        (lambda kv: kv.allocate("e", [-5], num_new_tokens=1, start=True), "new_token_ids"),
        (
            lambda kv: kv.allocate("e", tokens(0, 300), num_new_tokens=300, start=True),
            "max_model_len",
        ),
        (lambda kv: kv.allocate("", [1], num_new_tokens=1, start=True), "request_id"),
        (lambda kv: kv.allocate("e", [], num_new_tokens=1, start=True), "new_token_ids"),
        (lambda kv: kv.lookup([2**31]), "token_ids"),
    ],
)
def test_bad_input_is_invalid_argument_and_changes_nothing(kv: KVCacheClient, call, field) -> None:  # type: ignore[no-untyped-def]
    before = kv.usage()
    with pytest.raises(InvalidArgumentError) as err:
        call(kv)
    assert field in err.value.details
    after = kv.usage()
    assert (after.num_free_blocks, after.num_requests) == (
        before.num_free_blocks,
        before.num_requests,
    )


def test_second_first_call_for_a_live_request_is_rejected(kv: KVCacheClient) -> None:
    kv.allocate("dup", tokens(100, 10), num_new_tokens=10, start=True)
    before = kv.usage()
    # (The same call again is a safe retry: tests/server/test_safe_retries.py.)
    with pytest.raises(AlreadyExistsError, match=r"already live"):
        kv.allocate("dup", tokens(100, 11), num_new_tokens=11, start=True)
    assert kv.block_table("dup").num_computed_tokens == 10
    assert kv.usage().num_free_blocks == before.num_free_blocks


def test_unknown_pool_and_request_are_not_found(server: ServerThread, kv: KVCacheClient) -> None:
    with (
        KVCacheClient(server.address, pool="nosuchpool") as other,
        pytest.raises(NotFoundError, match="nosuchpool"),
    ):
        other.usage()
    with pytest.raises(NotFoundError):
        kv.allocate("ghost", [1], num_new_tokens=1)
    with pytest.raises(NotFoundError):
        kv.free("ghost")
    with pytest.raises(NotFoundError):
        kv.block_table("ghost")


def test_free_with_one_unknown_id_frees_nothing(kv: KVCacheClient) -> None:
    kv.allocate("f1", tokens(300, 20), num_new_tokens=20, start=True)
    before = kv.usage()
    with pytest.raises(NotFoundError):
        kv.free("f1", "ghost")
    assert kv.usage().num_requests == before.num_requests
    assert kv.block_table("f1").num_computed_tokens == 20


def test_pool_not_ready_is_failed_precondition(server: ServerThread) -> None:
    with (
        KVCacheClient(server.address, pool="waiting") as client,
        pytest.raises(NotReadyError, match="0 of 2 ranks"),
    ):
        client.allocate("a", [1], num_new_tokens=1, start=True)


def test_reset_prefix_cache_refused_while_blocks_are_held(kv: KVCacheClient) -> None:
    kv.allocate("held", tokens(400, 32), num_new_tokens=32, start=True)
    assert kv.reset_prefix_cache() is False
    kv.free("held")
    assert kv.reset_prefix_cache() is True
    assert kv.lookup(tokens(400, 32)) == 0


def test_events_replay_then_follow(server: ServerThread) -> None:
    with KVCacheClient(server.address, pool="tiny") as kv:
        kv.allocate("e1", tokens(500, 16), num_new_tokens=16, start=True)
        received: list = []
        done = threading.Event()

        def follow() -> None:
            for batch in kv.watch_events(from_sequence=1):
                received.append(batch)
                stored = [e for b in received for e in b.events if isinstance(e, BlockStored)]
                if len(stored) >= 2:
                    done.set()
                    return

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        kv.allocate("e2", tokens(600, 16), num_new_tokens=16, start=True)
        assert done.wait(10)
        stored = [e for b in received for e in b.events if isinstance(e, BlockStored)]
        assert stored[0].token_ids == tuple(tokens(500, 16))
        assert stored[0].parent_block_hash is None
        assert stored[1].token_ids == tuple(tokens(600, 16))
        assert [b.sequence for b in received] == list(range(1, len(received) + 1))
        kv.free("e1", "e2")


def test_auth_token_is_required_when_configured() -> None:
    secret = "s3cret-0123456789abcdef"
    with running_server(PoolConfig(name="p", max_model_len=64), auth_token=secret) as srv:
        with (
            KVCacheClient(srv.address, pool="p", options=ClientOptions(token="")) as anon,
            pytest.raises(UnauthenticatedError, match="missing"),
        ):
            anon.list_pools()
        with (
            KVCacheClient(srv.address, pool="p", options=ClientOptions(token="wrong")) as wrong,
            pytest.raises(UnauthenticatedError, match="unknown token"),
        ):
            wrong.list_pools()
        with KVCacheClient(srv.address, pool="p", options=ClientOptions(token=secret)) as ok:
            assert [p.name for p in ok.list_pools()] == ["p"]


def test_send_future_then_runs_on_the_sender_thread_in_order(kv: KVCacheClient) -> None:
    """``then`` runs on the client's sender thread once each reply is in, in the order the
    Steps were sent; ``then_result()`` gives its value, or raises what it raised while
    ``result()`` still gives the results; a failed Step raises from both and its
    ``then`` never runs."""
    seen: list[tuple[str, int]] = []

    def note(results: Any) -> int:
        seen.append((threading.current_thread().name, results[0].num_computed_tokens))
        return int(results[0].num_computed_tokens)

    admit = kv.step()
    admit.allocate("th", tokens(11000, 20), 20, start=True)
    futures = [admit.send_future(then=note)]
    for token in (1, 2, 3):
        grow = kv.step()
        grow.allocate("th", [token], 1)
        futures.append(grow.send_future(then=note))
    assert [future.then_result() for future in futures] == [20, 21, 22, 23]
    assert [count for _, count in seen] == [20, 21, 22, 23]
    assert {name for name, _ in seen} == {"kvsvc-step"}
    assert all(future.done() for future in futures)

    def broken(results: Any) -> None:
        raise ValueError(f"checked {len(results)}")

    grow = kv.step()
    grow.allocate("th", [4], 1)
    failing_check = grow.send_future(then=broken)
    with pytest.raises(ValueError, match="checked 1"):
        failing_check.then_result()
    assert failing_check.result()[0].num_computed_tokens == 24

    refused = kv.step()
    refused.allocate("th", [5], 1)
    refused.free_queue_head_limit = 10**7  # past the bound: the whole Step is refused
    failed = refused.send_future(then=note)
    with pytest.raises(InvalidArgumentError, match="free_queue_head_limit"):
        failed.result()
    with pytest.raises(InvalidArgumentError, match="free_queue_head_limit"):
        failed.then_result()
    assert len(seen) == 4
    kv.free("th")


def test_step_lookup_free_queue_head_and_send_future(kv: KVCacheClient) -> None:
    """A Step's LOOKUP sees the operations before it; the free queue's head names the next
    blocks; ``send_future`` returns before the reply and ``result()`` gives the results."""
    from kvsvc_client import LookupResult

    prompt = tokens(27000, 40)
    step = kv.step()
    step.allocate("la", prompt, 512, start=True)
    step.lookup([*prompt[:32], 1, 2])
    step.free_queue_head_limit = 4
    results = step.send()
    admitted, hit = results[0], results[1]
    assert isinstance(hit, LookupResult)
    assert hit.num_cached_tokens == 32
    assert hit.block_ids[0] == admitted.new_block_ids[0][:2]
    head = results.free_queue_head
    assert len(head) == 4 and results.num_free_blocks == USABLE_BLOCKS - 3
    later = kv.step()
    later.allocate("lb", tokens(29000, 33), 512, start=True)
    pending = later.send_future()
    (outcome,) = pending.result()
    assert outcome.new_block_ids[0] == tuple(head[:3])
    assert pending.done()
    kv.free("la", "lb")
