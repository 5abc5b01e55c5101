"""Step's LOOKUP operation and the free-queue head: what an engine that predicts its block
ids (kvsvc.integrations.vllm) relies on.

* LOOKUP answers exactly as the admission that follows it in the same batch would start
  (same hit length, same blocks), on both Step paths, and changes nothing.
* ``free_queue_head`` lists the ids the next allocations take, in that order.
"""

from __future__ import annotations

import pytest

from kvsvc.core import PoolKVCache
from kvsvc.errors import InvalidArgument
from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.step import apply_step
from kvsvc.server.wire import StepColumns
from kvsvc.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from kvsvc.v1 import kvcache_pb2 as pb

ALLOCATE = pb.STEP_OPERATION_TYPE_ALLOCATE
FREE = pb.STEP_OPERATION_TYPE_FREE
LOOKUP = pb.STEP_OPERATION_TYPE_LOOKUP


def plain_pool() -> PoolKVCache:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks=16, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return PoolKVCache(config, max_model_len=64, hash_seed="seed")


def hybrid_pool() -> PoolKVCache:
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8
    )
    config = KVCacheConfig(
        num_blocks=32,
        kv_cache_groups=[KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], window)],
    )
    return PoolKVCache(config, max_model_len=64, hash_seed="seed")


def step(
    cache: PoolKVCache,
    ops: list[tuple[int, str, list[int], int, bool]],
    head: int = 0,
    counters: EngineCounters | None = None,
):
    request = pb.StepRequest(pool="p", free_queue_head_limit=head)
    for index, (kind, rid, tokens, new, first) in enumerate(ops):
        request.types.append(kind)
        request.request_ids.append(rid)
        request.num_token_ids.append(len(tokens))
        request.token_ids.extend(tokens)
        request.num_new_tokens.append(new)
        request.num_lookahead_tokens.append(0)
        request.num_rejected_tokens.append(0)
        if first:
            request.starts[index].CopyFrom(pb.RequestStart())
    counted = counters if counters is not None else EngineCounters()
    return apply_step(cache, StepColumns(request, 8192), counted).to_pb()


def groups_of(response: pb.StepResponse, op: int) -> list[list[int]]:
    """The block ids of operation ``op`` per group (operation-major columns)."""
    g = response.num_groups
    counts = list(response.num_new_blocks)
    start = sum(counts[: op * g])
    out = []
    for n in counts[op * g : (op + 1) * g]:
        out.append(list(response.new_block_ids[start : start + n]))
        start += n
    return out


@pytest.mark.parametrize("make", [plain_pool, hybrid_pool], ids=["plain", "hybrid"])
def test_lookup_in_a_batch_matches_the_admission_after_it(make) -> None:
    cache = make()
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    step(cache, [(ALLOCATE, "a", prompt, 13, True)])
    step(cache, [(FREE, "a", [], 0, False)])
    usage_before = cache.usage()
    response = step(cache, [(LOOKUP, "", [*prompt, 99, 98], 0, False)])
    assert cache.usage() == usage_before, "a lookup must change nothing (stats included)"
    assert response.num_cached_tokens[0] == 12
    hits = groups_of(response, 0)
    response = step(
        cache, [(LOOKUP, "", [*prompt, 99], 0, False), (ALLOCATE, "b", [*prompt, 99], 14, True)]
    )
    assert response.num_cached_tokens[0] == response.num_cached_tokens[1] == 12
    admitted = groups_of(response, 1)
    for hit, table in zip(hits, admitted, strict=True):
        assert table[: len(hit)] == hit
    assert groups_of(response, 0) == hits


@pytest.mark.parametrize("make", [plain_pool, hybrid_pool], ids=["plain", "hybrid"])
def test_a_lookup_or_a_free_is_not_counted_as_an_allocation(make) -> None:
    """kvsvc_allocate_total{outcome="ok"} counts allocations: a Step's lookups and frees
    succeed without being one, whether every operation succeeded or one got NO_SPACE."""
    cache = make()
    counters = EngineCounters()
    prompt = list(range(1, 14))
    step(cache, [(ALLOCATE, "a", prompt, 13, True)], counters=counters)
    assert (counters.allocate_ok, counters.allocate_no_space) == (1, 0)
    step(
        cache,
        [(LOOKUP, "", prompt, 0, False), (ALLOCATE, "a", [7], 1, False), (FREE, "a", [], 0, False)],
        counters=counters,
    )
    assert (counters.allocate_ok, counters.allocate_no_space) == (2, 0)
    # Admissions until the pool is out of blocks, each beside a lookup that succeeds.
    admitted = refused = 0
    for k in range(8):
        response = step(
            cache,
            [(LOOKUP, "", prompt, 0, False), (ALLOCATE, f"big{k}", list(range(1, 64)), 63, True)],
            counters=counters,
        )
        if list(response.statuses)[1] == pb.ALLOCATE_STATUS_NO_SPACE:
            refused += 1
        else:
            admitted += 1
    assert refused > 0
    assert (counters.allocate_ok, counters.allocate_no_space) == (2 + admitted, refused)


def test_free_queue_head_names_the_next_allocations() -> None:
    cache = plain_pool()
    response = step(cache, [(ALLOCATE, "a", list(range(1, 10)), 9, True)], head=5)
    assert response.num_free_blocks == cache.usage().num_free_blocks == 12
    predicted = list(response.free_queue_head)
    assert len(predicted) == 5
    # Free "a" (its partial block goes to the front, its full cached ones to the back),
    # then take four blocks: they come in the order the reply said, as adjusted.
    response = step(cache, [(FREE, "a", [], 0, False)], head=16)
    head = list(response.free_queue_head)
    assert len(head) == response.num_free_blocks == 15
    response = step(cache, [(ALLOCATE, "b", [7] * 16, 16, True)])
    assert groups_of(response, 0)[0] == head[:4]


def test_free_queue_head_limit_is_bounded() -> None:
    request = pb.StepRequest(pool="p", free_queue_head_limit=70000)
    with pytest.raises(InvalidArgument, match="free_queue_head_limit"):
        StepColumns(request, 8192)


def test_lookup_rejects_scheduling_fields() -> None:
    cache = plain_pool()
    response = step(cache, [(LOOKUP, "", [1, 2, 3, 4, 5], 3, False)])
    assert response.statuses[0] == pb.ALLOCATE_STATUS_UNSPECIFIED
    assert "lookup" in response.errors[0].message
