"""Reading a pool's free queue page by page (``free_queue_head_offset``), issue 32.

A page at offset k of the queue's cached (LRU) region used to walk k links on the event
loop: a 13-byte Step could hold a 4M-block pool's loop for most of a second. A page now
costs O(page): it starts from the queue's front, its back, or where the last page ended,
and one that would walk further than ``MAX_FREE_QUEUE_WALK`` first is refused, whole and
before anything changed. What an engine needs still works: vLLM on kvsvc reads an idle
pool's whole queue at start, page after page, however large the pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from kvsvc_client import KVCacheClient

from kvsvc.core import MAX_FREE_QUEUE_WALK, PoolKVCache, RequestStart
from kvsvc.errors import InvalidArgument
from kvsvc.integrations.vllm.config import settings_from_additional_config, vllm_kwargs
from kvsvc.integrations.vllm.manager import KvsvcPoolReplica
from kvsvc.server.config import PoolConfig
from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.step import apply_step
from kvsvc.server.wire import StepColumns
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvsvc.v1 import kvcache_pb2 as pb
from kvsvc.v1 import kvcache_pb2_grpc
from tests.server.harness import ServerThread, bring_up, llama_like_specs, running_server

# A pool of one-token blocks whose cached region is longer than two walks: a page in its
# middle is more than MAX_FREE_QUEUE_WALK links from both of its ends.
NUM_BLOCKS = 2 * MAX_FREE_QUEUE_WALK + 9_000
PROMPT = 8_000
MAX_MODEL_LEN = 8_192


def cached_pool(num_blocks: int) -> PoolKVCache:
    """A pool whose every block was cached and freed: all of its free queue is the LRU
    region (a pool that served for a while)."""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    cache = PoolKVCache(config, max_model_len=MAX_MODEL_LEN, hash_seed="seed")
    n = 0
    while n < num_blocks - 1:
        size = min(PROMPT, num_blocks - 1 - n)
        rid = f"r{n}"
        assert cache.allocate(rid, [n, *range(size - 1)], size, start=RequestStart()).ok
        cache.free([rid])
        n += size
    return cache


def page(cache: PoolKVCache, offset: int, limit: int = 65536, ops: int = 0) -> pb.StepResponse:
    request = pb.StepRequest(pool="p", free_queue_head_limit=limit, free_queue_head_offset=offset)
    for i in range(ops):
        request.types.append(pb.STEP_OPERATION_TYPE_FREE)
        request.request_ids.append(f"gone{i}")
    for name in ("num_token_ids", "num_new_tokens", "num_lookahead_tokens", "num_rejected_tokens"):
        getattr(request, name).extend([0] * ops)
    return apply_step(cache, StepColumns(request, 8192), EngineCounters()).to_pb()


@pytest.fixture(scope="module")
def lru_pool() -> PoolKVCache:
    cache = cached_pool(NUM_BLOCKS)
    assert cache.usage().num_cached_blocks == NUM_BLOCKS - 1
    return cache


def test_a_far_page_of_the_cached_region_is_refused_and_an_ordered_read_is_not(
    lru_pool: PoolKVCache,
) -> None:
    queue = list(lru_pool.manager.block_pool.free_queue)
    middle = NUM_BLOCKS // 2
    lru_pool.manager.block_pool.free_queue.load_state(
        lru_pool.manager.block_pool.free_queue.to_state()
    )  # no cursor left by an earlier read
    with pytest.raises(InvalidArgument, match="free_queue_head_offset: position") as err:
        page(lru_pool, middle, 8)
    assert f"more than {MAX_FREE_QUEUE_WALK}" in str(err.value)
    # Ends are cheap, and past the end is an empty page.
    assert list(page(lru_pool, 0, 10).free_queue_head) == queue[:10]
    assert list(page(lru_pool, len(queue) - 5).free_queue_head) == queue[-5:]
    assert list(page(lru_pool, 2**31 - 1).free_queue_head) == []
    # Read in order, page after page: every page is served, the middle one included.
    order: list[int] = []
    while True:
        got = list(page(lru_pool, len(order)).free_queue_head)
        order.extend(got)
        if len(got) < 65536:
            break
    assert order == queue


def test_a_page_past_the_front_comes_only_without_operations(lru_pool: PoolKVCache) -> None:
    with pytest.raises(InvalidArgument, match="only in a Step without operations"):
        page(lru_pool, 1, ops=1)
    assert len(page(lru_pool, 0, 4, ops=1).free_queue_head) == 4  # the front: as before


@pytest.fixture(scope="module")
def big_server() -> Iterator[ServerThread]:
    config = PoolConfig(
        name="p", world_size=1, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS
    )
    with running_server(config) as thread:
        ranks = bring_up(
            thread, "p", specs=llama_like_specs(num_layers=1, block_size=1), kv_cache_bytes=1 << 32
        )
        with KVCacheClient(thread.address, "p") as kv:
            n = 0
            while n < NUM_BLOCKS - 1:
                size = min(PROMPT, NUM_BLOCKS - 1 - n)
                assert kv.allocate(f"r{n}", [n, *range(size - 1)], size, start=True).ok
                kv.free(f"r{n}")
                n += size
        yield thread
        for rank in ranks:
            rank.close()


def test_vllm_on_kvsvc_reads_a_large_cached_pool_at_start(big_server: ServerThread) -> None:
    """The replica pages the whole queue (three pages of 65,536 ids, the middle one deep
    in the cached region) and starts with the server's exact order."""
    pool = big_server.server.pools.by_name["p"]
    plan = big_server.run(lambda: pool.plan)
    settings = settings_from_additional_config(
        vllm_kwargs(big_server.address, "p")["additional_config"]
    )
    replica = KvsvcPoolReplica(
        replace(settings, rpc_timeout=30.0),
        config=plan.scheduler_config,
        block_size=plan.block_size,
        max_model_len=MAX_MODEL_LEN,
        enable_caching=True,
    )
    try:
        served = big_server.run(lambda: list(pool.cache.manager.block_pool.free_queue))
        assert list(replica.cache.manager.block_pool.free_queue) == served
    finally:
        replica.close()


def test_a_far_page_over_grpc_is_invalid_argument_and_changes_nothing(
    big_server: ServerThread,
) -> None:
    pool = big_server.server.pools.by_name["p"]
    with grpc.insecure_channel(big_server.address) as channel:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        # A change moves the queue (the cursor of any earlier read is gone).
        with KVCacheClient(big_server.address, "p") as kv:
            assert kv.allocate("x", [1, 2, 3], 3, start=True).ok
            kv.free("x")
        before = big_server.run(lambda: pool.cache.usage())
        with pytest.raises(grpc.RpcError) as err:
            stub.Step(
                pb.StepRequest(
                    pool="p", free_queue_head_limit=8, free_queue_head_offset=NUM_BLOCKS // 2
                ),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "free_queue_head_offset" in (err.value.details() or "")
        assert big_server.run(lambda: pool.cache.usage()) == before
        # The attack of issue 32 (offset 2^31 - 1) is an empty page at once.
        reply = stub.Step(
            pb.StepRequest(pool="p", free_queue_head_limit=65536, free_queue_head_offset=2**31 - 1),
            timeout=10,
        )
        assert list(reply.free_queue_head) == []
