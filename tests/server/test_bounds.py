"""Bounds on what clients send, against a real server (issue 9, "Hardening").

Each test is the regression test of one reproduced defect: past a bound the caller gets a
clear code naming the bound, nothing changes, and other clients are not held up.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from kvsvc_client import (
    HashingContext,
    InvalidArgumentError,
    KVCacheClient,
    MultiModalItem,
    OperationError,
    RequestStart,
    ResourceExhaustedError,
)

from kvsvc.convert import layer_specs_to_pb
from kvsvc.core import MAX_MM_ITEMS, BlockHasher
from kvsvc.server.config import PoolConfig
from kvsvc.server.pool import Pool
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc, worker_pb2
from tests.server.harness import (
    FakeRank,
    ServerThread,
    bring_up,
    llama_like_specs,
    running_server,
    tidy_client,
)

MAX_MODEL_LEN = 256
MAX_REQUESTS = 4
# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16
# The long-lookup pool: one tiny layer (512 B a block) and room for long prompts.
LONG_LEN = 32_768
TINY_SPECS = llama_like_specs(num_layers=1, num_kv_heads=1, head_size=8)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pools = (
        PoolConfig(name="p", max_model_len=MAX_MODEL_LEN, max_requests=MAX_REQUESTS),
        PoolConfig(name="long", max_model_len=LONG_LEN, hash_algo="sha256_cbor"),
    )
    with running_server(*pools) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=65 * BYTES_PER_BLOCK)
        ranks += bring_up(srv, "long", specs=TINY_SPECS, kv_cache_bytes=3000 * 512)
        yield srv
        for rank in ranks:
            rank.close()


@pytest.fixture()
def kv(server: ServerThread) -> Iterator[KVCacheClient]:
    with tidy_client(server) as client:
        yield client


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def state(kv: KVCacheClient) -> tuple[int, int]:
    usage = kv.usage()
    return usage.num_free_blocks, usage.num_requests


def stub(server: ServerThread) -> kvcache_pb2_grpc.KVCacheServiceStub:
    return kvcache_pb2_grpc.KVCacheServiceStub(grpc.insecure_channel(server.address))


# -- 3. max_requests -------------------------------------------------------------------------


def test_admissions_beyond_max_requests_are_resource_exhausted(kv: KVCacheClient) -> None:
    """Regression: max_requests was never read (200,000 admissions were accepted)."""
    for i in range(MAX_REQUESTS):
        assert kv.allocate(f"r{i}", tokens(100 * i, 10), 10, start=True).ok
    before = state(kv)
    with pytest.raises(ResourceExhaustedError, match=f"max_requests={MAX_REQUESTS}") as err:
        kv.allocate("one-too-many", tokens(900, 10), 10, start=True)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert state(kv) == before
    # A Step admission gets its per-operation error; the other operations still run.
    step = kv.step()
    step.allocate("r0", [7], 1)
    step.allocate("step-too-many", tokens(900, 10), 10, start=True)
    decode, refused = step.send()
    assert not isinstance(decode, OperationError) and decode.ok
    assert isinstance(refused, OperationError)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_requests" in refused.message
    assert kv.usage().num_requests == MAX_REQUESTS
    # Room again after a free.
    kv.free("r1")
    assert kv.allocate("one-too-many", tokens(900, 10), 10, start=True).ok


# -- 4. max_model_len for continuations --------------------------------------------------------


def test_a_packed_continuation_past_max_model_len_is_refused(
    kv: KVCacheClient, server: ServerThread
) -> None:
    """Regression: ``kv.allocate("r", [5]*3000, 1)`` (packed by the client) on a live
    request returned OK and grew it past max_model_len."""
    assert kv.allocate("r", tokens(0, 20), 20, start=True).ok
    before = (kv.block_table("r"), state(kv))
    with pytest.raises(InvalidArgumentError, match=f"max_model_len={MAX_MODEL_LEN}"):
        kv.allocate("r", [5] * 3000, 1)
    with pytest.raises(InvalidArgumentError, match=f"max_model_len={MAX_MODEL_LEN}"):
        kv.allocate("r", [5] * (MAX_MODEL_LEN - 20 + 1), 1)
    # Raw packed bytes, and a Step continuation with packed token ids.
    raw = stub(server)
    packed = bytes(4) * 3000
    with pytest.raises(grpc.RpcError) as err:
        raw.Allocate(
            kvcache_pb2.AllocateRequest(
                pool="p", request_id="r", packed_new_token_ids=packed, num_new_tokens=1
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    step = kv.step()
    step.allocate("r", [5] * 3000, 1)
    (result,) = step.send()
    assert isinstance(result, OperationError) and "max_model_len" in result.message
    assert (kv.block_table("r"), state(kv)) == before
    assert kv.allocate("r", [5] * (MAX_MODEL_LEN - 20), 1).ok


# -- 5. Lookup: a length cap, and no stall of the writers ----------------------------------------


def test_a_lookup_longer_than_max_model_len_is_invalid_argument(
    kv: KVCacheClient, server: ServerThread
) -> None:
    """Regression: a 15.7M-token Lookup was hashed (7.5 s) under the writer lock."""
    with pytest.raises(InvalidArgumentError, match=f"max_model_len={MAX_MODEL_LEN}") as err:
        kv.lookup([1] * (MAX_MODEL_LEN + 1))  # packed by the client
    # The client packed them; the message names lookup's own argument (issue 34).
    assert err.value.details.startswith("token_ids: ") and "packed" not in err.value.details
    with pytest.raises(grpc.RpcError) as raw_err:
        stub(server).Lookup(
            kvcache_pb2.LookupRequest(pool="p", token_ids=[1] * (MAX_MODEL_LEN + 1)), timeout=10
        )
    assert raw_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in (raw_err.value.details() or "")
    step = kv.step()
    step.lookup([1] * (MAX_MODEL_LEN + 1))
    (result,) = step.send()
    assert isinstance(result, OperationError) and "max_model_len" in result.message
    assert kv.lookup([1] * MAX_MODEL_LEN) == 0


@pytest.mark.patches_core
def test_a_long_lookup_does_not_stall_the_pools_writers(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a Lookup's prompt is being hashed, Allocate and Free of its pool go on.

    The hashing is made to wait (deterministically, instead of by timing) until the test
    has seen a writer through; before the fix the Lookup hashed under the pool's lock (or
    on the event loop itself), so the writer timed out.
    """
    original = BlockHasher.hash_blocks
    entered, release = threading.Event(), threading.Event()

    def slow_hash_blocks(self: BlockHasher, token_ids: Any, first: int, num: int, *a: Any) -> Any:
        if num >= 1000:  # the long lookup's prompt, not the admissions' short ones
            entered.set()
            release.wait(10)
        return original(self, token_ids, first, num, *a)

    monkeypatch.setattr(BlockHasher, "hash_blocks", slow_hash_blocks)
    prompt = tokens(0, LONG_LEN)
    with KVCacheClient(server.address, pool="long") as kv:
        assert kv.allocate("cached", prompt[:64], 64, start=True).ok
        answer: list[int] = []
        worker = threading.Thread(target=lambda: answer.append(kv.lookup(prompt, timeout=30)))
        worker.start()
        try:
            assert entered.wait(10), "the lookup never started hashing"
            with KVCacheClient(server.address, pool="long") as writer:
                assert writer.allocate("w", tokens(50_000, 20), 20, start=True, timeout=3).ok
                assert writer.allocate("w", [1], 1, timeout=3).ok
                assert writer.free("w", timeout=3) > 0
                assert writer.usage(timeout=3).num_requests == 1
        finally:
            release.set()
            worker.join(30)
        assert answer == [64]
        kv.free("cached")


# -- 8. multimodal items must lie inside the prompt ----------------------------------------------


def mm_context(offset: int, length: int) -> HashingContext:
    return HashingContext(mm_items=(MultiModalItem("image-0", offset, length),))


@pytest.mark.parametrize(("offset", "length"), [(2, 10**9), (40, 1), (0, 41)])
def test_multimodal_items_outside_the_prompt_are_invalid_argument(
    kv: KVCacheClient, offset: int, length: int
) -> None:
    """Regression: an item of length 10^9, or starting past the prompt, was accepted."""
    prompt = tokens(0, 40)
    context = mm_context(offset, length)
    before = state(kv)
    with pytest.raises(InvalidArgumentError, match=r"mm_items\[0\].*inside the prompt"):
        kv.allocate("mm", prompt, 40, start=RequestStart(hashing=context))
    with pytest.raises(InvalidArgumentError, match=r"mm_items\[0\]"):
        kv.lookup(prompt, context)
    step = kv.step()
    step.allocate("mm", prompt, 40, start=RequestStart(hashing=context))
    step.lookup(prompt, context)
    admit, look = step.send()
    for result in (admit, look):
        assert isinstance(result, OperationError)
        assert result.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "mm_items[0]" in result.message
    assert state(kv) == before
    assert kv.allocate("mm", prompt, 40, start=RequestStart(hashing=mm_context(2, 38))).ok


def test_multimodal_items_are_bounded_in_number_and_identifier_bytes(kv: KVCacheClient) -> None:
    prompt = tokens(0, 40)
    many = HashingContext(
        mm_items=tuple(MultiModalItem(f"i{i}", 0, 1) for i in range(MAX_MM_ITEMS + 1))
    )
    long_id = HashingContext(mm_items=(MultiModalItem("x" * 257, 0, 4),))
    before = state(kv)
    with pytest.raises(InvalidArgumentError, match=f"limit of {MAX_MM_ITEMS}"):
        kv.allocate("mm", prompt, 40, start=RequestStart(hashing=many))
    with pytest.raises(InvalidArgumentError, match=r"mm_items\[0\]\.identifier.*256 bytes"):
        kv.allocate("mm", prompt, 40, start=RequestStart(hashing=long_id))
    with pytest.raises(InvalidArgumentError, match=f"limit of {MAX_MM_ITEMS}"):
        kv.lookup(prompt, many)
    assert state(kv) == before


# -- Free's reason must be a known FreeReason ----------------------------------------------------


def test_an_unknown_free_reason_is_invalid_argument(
    kv: KVCacheClient, server: ServerThread
) -> None:
    """Regression: ``FreeRequest.reason=99`` was taken as FINISHED."""
    assert kv.allocate("f", tokens(0, 20), 20, start=True).ok
    before = state(kv)
    with pytest.raises(grpc.RpcError) as err:
        stub(server).Free(
            kvcache_pb2.FreeRequest(pool="p", request_ids=["f"], reason=99),  # type: ignore[arg-type]
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reason" in (err.value.details() or "")
    assert "FREE_REASON_PREEMPTED=2" in (err.value.details() or "")
    assert state(kv) == before
    assert kv.free("f") > 0


# -- 6. memory claims and the number of planned blocks ------------------------------------------


def register(srv: ServerThread, pool: str, **memory: int) -> FakeRank:
    """A rank of ``pool`` registered with exactly these memory figures."""
    rank = FakeRank(srv.address, pool, 0, 1, llama_like_specs(), 0)
    response = rank.stub.Register(
        worker_pb2.RegisterRequest(
            pool=pool,
            rank=0,
            world_size=1,
            device="cpu",
            hostname="test",
            layers=layer_specs_to_pb(rank.specs),
            memory=worker_pb2.MemoryProfile(**memory),
        ),
        timeout=10,
    )
    rank.session_id = response.session_id
    return rank


def num_registered(srv: ServerThread, pool: str) -> int:
    return int(srv.run(lambda: len(srv.server.pools.by_name[pool].slots)))


@pytest.mark.parametrize(
    ("memory", "field"),
    [
        ({"kv_cache_bytes": 2**50}, "memory.kv_cache_bytes"),
        ({"total_bytes": 2**50}, "memory.total_bytes"),
        ({"total_bytes": 2**30, "kv_cache_bytes": 2**31}, "memory.kv_cache_bytes"),
        ({"total_bytes": 2**30, "free_bytes": 2**31, "kv_cache_bytes": 2**20}, "memory.free"),
        ({"total_bytes": 2**30, "non_kv_bytes": 2**31}, "memory.non_kv_bytes"),
    ],
    ids=["kv-huge", "total-huge", "kv-over-total", "free-over-total", "non-kv-over-total"],
)
def test_memory_claims_no_device_has_are_refused_at_register(
    memory: dict[str, int], field: str
) -> None:
    """Regression: a claim of 2^50 bytes reached the block pool (MemoryError, INTERNAL) and
    left the pool "1/1 registered, not allocated"."""
    with running_server(PoolConfig(name="m", max_model_len=MAX_MODEL_LEN)) as srv:
        with pytest.raises(grpc.RpcError) as err:
            register(srv, "m", **memory)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or "")
        assert num_registered(srv, "m") == 0
        # A sane claim then plans as usual.
        ranks = bring_up(srv, "m", kv_cache_bytes=65 * BYTES_PER_BLOCK)
        ranks[0].close()


def plan_error(rank: FakeRank) -> str:
    rank.open_stream()
    update = rank.wait_for_config()
    assert not update.HasField("config")
    return update.error


@pytest.mark.parametrize(
    ("limit", "claim"),
    [(1000, 2000 * BYTES_PER_BLOCK), (None, 2**40)],
    ids=["configured", "default-1TiB-claim"],
)
def test_a_plan_above_max_num_blocks_fails_cleanly(limit: int | None, claim: int) -> None:
    """A claim under the byte cap can still mean millions of blocks: the plan fails (with
    the default bound, 1 TiB of 32 KiB blocks is 33M blocks) before any is built."""
    extra = {} if limit is None else {"max_num_blocks": limit}
    pool = PoolConfig(name="m", max_model_len=MAX_MODEL_LEN, **extra)  # type: ignore[arg-type]
    with running_server(pool) as srv:
        rank = register(srv, "m", total_bytes=2**41, kv_cache_bytes=claim)
        error = plan_error(rank)
        assert f"max_num_blocks={pool.max_num_blocks}" in error
        assert "num_gpu_blocks_override" in error
        assert num_registered(srv, "m") == 0
        rank.close()
        ranks = bring_up(srv, "m", kv_cache_bytes=900 * BYTES_PER_BLOCK)
        ranks[0].close()


def test_any_failure_while_building_the_pool_leaves_nothing_half_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MemoryError (or any other) while the manager is built is a planning failure:
    registrations dropped, error recorded and streamed, never INTERNAL."""
    original = Pool._build_cache
    calls: list[int] = []

    def failing_build(self: Pool, plan: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("simulated")
        return original(self, plan)

    monkeypatch.setattr(Pool, "_build_cache", failing_build)
    with running_server(PoolConfig(name="m", max_model_len=MAX_MODEL_LEN)) as srv:
        rank = register(srv, "m", kv_cache_bytes=65 * BYTES_PER_BLOCK)  # no INTERNAL
        error = plan_error(rank)
        assert "MemoryError" in error
        assert num_registered(srv, "m") == 0
        assert srv.run(lambda: srv.server.pools.by_name["m"].state.name) == "WAITING_FOR_WORKERS"
        with KVCacheClient(srv.address, pool="m") as kv:
            assert "MemoryError" in kv.list_pools()[0].error
        rank.close()
        ranks = bring_up(srv, "m", kv_cache_bytes=65 * BYTES_PER_BLOCK)
        ranks[0].close()


# -- 9. a planning failure reaches every rank's plan stream -------------------------------------


def test_a_planning_failure_is_reported_on_every_ranks_plan_stream() -> None:
    """Regression: with two ranks at 64 MiB and max_model_len 4096 the rank that registered
    first never heard of the failure (its plan stream was not woken) and waited forever in
    WAITING_FOR_WORKERS. The worker agent stops on a plan-stream error (PLAN_FAILED), so
    each rank's stream must carry it."""
    pool = PoolConfig(name="two", world_size=2, max_model_len=4096)
    with running_server(pool) as srv:
        ranks = [
            FakeRank(srv.address, "two", r, 2, llama_like_specs(), 4 * BYTES_PER_BLOCK)
            for r in range(2)
        ]
        ranks[0].register()
        ranks[0].stream = ranks[0].stub.WatchPlan(
            worker_pb2.WatchPlanRequest(pool="two", rank=0, session_id=ranks[0].session_id),
            timeout=10,
        )
        assert not ranks[0].next_update().error  # waiting for rank 1
        ranks[1].register()  # the pool is complete: planning fails (memory too small)
        ranks[1].stream = ranks[1].stub.WatchPlan(
            worker_pb2.WatchPlanRequest(pool="two", rank=1, session_id=ranks[1].session_id),
            timeout=10,
        )
        errors = []
        for rank in ranks:
            update = rank.wait_for_config()  # DEADLINE_EXCEEDED before the fix
            assert not update.HasField("config")
            errors.append(update.error)
        assert all("max_model_len" in e or "GiB" in e for e in errors), errors
        assert errors[0] == errors[1]
        assert num_registered(srv, "two") == 0
        for rank in ranks:
            rank.close()
