"""The columnar Step path for full-attention pools answers exactly as the general one.

Both paths run the same random batches (admissions, decodes, chunked prefills, frees,
preemptions, speculative steps, invalid operations) against two identical pools; their
response columns and the pools' block tables must agree after every batch.
"""

from __future__ import annotations

import array

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core import PoolKVCache
from kvsvc.server.engine_stats import EngineCounters
from kvsvc.server.step import _apply_general, _apply_plain, apply_step
from kvsvc.server.wire import StepColumns
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvsvc.v1 import kvcache_pb2 as pb

ALLOCATE = pb.STEP_OPERATION_TYPE_ALLOCATE
FREE = pb.STEP_OPERATION_TYPE_FREE
PREEMPT = pb.STEP_OPERATION_TYPE_PREEMPT
REQUESTS = [f"r{i}" for i in range(6)]


def make_pool() -> PoolKVCache:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    config = KVCacheConfig(num_blocks=24, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return PoolKVCache(config, max_model_len=64, hash_seed="seed")


operation = st.one_of(
    # (kind, request, tokens, num_new_tokens, lookahead, rejected, is_first)
    st.tuples(
        st.just(ALLOCATE),
        st.sampled_from(REQUESTS),
        st.lists(st.integers(0, 6), min_size=1, max_size=20),
        st.integers(0, 24),
        st.just(0),
        st.just(0),
        st.just(True),
    ),
    st.tuples(
        st.just(ALLOCATE),
        st.sampled_from(REQUESTS),
        # 2^31: an id the wire's uint32 carries but the server refuses (that operation only).
        st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 2**31]), max_size=2),
        st.integers(-1, 5),
        st.integers(0, 2),
        st.integers(0, 1),
        st.just(False),
    ),
    st.tuples(
        st.sampled_from([FREE, PREEMPT]),
        st.sampled_from(REQUESTS),
        st.just([]),
        st.just(0),
        st.just(0),
        st.just(0),
        st.just(False),
    ),
)


def build(ops: list[tuple], packed: bool = False) -> StepColumns:  # type: ignore[type-arg]
    request = pb.StepRequest(pool="p")
    for index, (kind, rid, tokens, new, lookahead, rejected, first) in enumerate(ops):
        request.types.append(kind)
        request.request_ids.append(rid)
        request.num_token_ids.append(len(tokens))
        request.token_ids.extend(tokens)
        request.num_new_tokens.append(new)
        request.num_lookahead_tokens.append(lookahead)
        request.num_rejected_tokens.append(rejected)
        if first:
            request.starts[index].CopyFrom(pb.RequestStart())
    ids = list(request.token_ids)
    if packed and ids and max(ids) < 2**31:
        # The compact wire form: the core then keeps prompts as arrays and hashes
        # completed blocks on its one-block fast path.
        del request.token_ids[:]
        request.packed_token_ids = array.array("I", ids).tobytes()
    return StepColumns(request, 8192)


@settings(deadline=None, max_examples=150)
@given(st.lists(st.lists(operation, max_size=12), min_size=1, max_size=8), st.booleans())
def test_plain_and_general_paths_agree(batches: list[list[tuple]], packed: bool) -> None:  # type: ignore[type-arg]
    plain_pool, general_pool = make_pool(), make_pool()
    assert plain_pool.has_plain_tables
    plain_counters, general_counters = EngineCounters(), EngineCounters()
    for ops in batches:
        plain = _apply_plain(plain_pool, build(ops, packed), plain_counters).to_pb()
        general = _apply_general(general_pool, build(ops, packed), general_counters).to_pb()
        assert plain == general, (ops, plain, general)
        for rid in REQUESTS:
            assert plain_pool.has_request(rid) == general_pool.has_request(rid)
            if plain_pool.has_request(rid):
                assert plain_pool.block_table(rid) == general_pool.block_table(rid)
                # Same hashes, whichever path hashed the blocks.
                assert (
                    plain_pool._requests[rid].block_hashes
                    == general_pool._requests[rid].block_hashes
                )
        assert plain_pool.usage() == general_pool.usage()
        plain_events, general_events = plain_pool.take_events(), general_pool.take_events()
        assert (plain_events and plain_events.events) == (general_events and general_events.events)
    assert plain_counters == general_counters


def test_decode_steps_hash_completed_blocks_like_the_general_path() -> None:
    """Packed prompts (kept as arrays) take the one-block hashing shortcut on decodes."""
    plain_pool, general_pool = make_pool(), make_pool()
    counters = EngineCounters()
    admit = [(ALLOCATE, rid, list(range(3 + i)), 24, 0, 0, True) for i, rid in enumerate(REQUESTS)]
    for pool, apply in ((plain_pool, _apply_plain), (general_pool, _apply_general)):
        apply(pool, build(admit, packed=True), counters)
        for token in range(10):  # every request completes two or three blocks
            decode = [(ALLOCATE, rid, [token], 1, 0, 0, False) for rid in REQUESTS]
            apply(pool, build(decode, packed=True), counters)
    for rid in REQUESTS:
        assert len(plain_pool._requests[rid].block_hashes) >= 3
        assert plain_pool._requests[rid].block_hashes == general_pool._requests[rid].block_hashes
    assert plain_pool.take_events().events == general_pool.take_events().events  # type: ignore[union-attr]


def _admit(pools: tuple[PoolKVCache, ...], prompts: dict[str, list[int]]) -> None:
    ops = [(ALLOCATE, rid, tokens, len(tokens), 0, 0, True) for rid, tokens in prompts.items()]
    for pool in pools:
        results = _apply_plain(pool, build(ops), EngineCounters()).to_pb()
        assert list(results.statuses) == [pb.ALLOCATE_STATUS_OK] * len(ops)


def _both_paths(ops: list[tuple], prompts: dict[str, list[int]]) -> pb.StepResponse:  # type: ignore[type-arg]
    """The decode Step ``ops`` after ``prompts``' admission, on each path: they agree
    (reply, tables, usage); the reply."""
    plain_pool, general_pool = make_pool(), make_pool()
    _admit((plain_pool, general_pool), prompts)
    plain = _apply_plain(plain_pool, build(ops), EngineCounters()).to_pb()
    general = _apply_general(general_pool, build(ops), EngineCounters()).to_pb()
    assert plain == general
    for rid in prompts:
        assert plain_pool.block_table(rid) == general_pool.block_table(rid)
    assert plain_pool.usage() == general_pool.usage()
    return plain


def test_a_decode_step_with_one_speculative_operation_allocates_its_lookahead() -> None:
    # Every operation a running request's allocation, so the Step is one run but for
    # the lookahead (or rejected drafts) of one: that one takes the general path.
    prompts = {"r0": [1, 2, 3], "r1": [4, 5, 6]}
    reply = _both_paths(
        [(ALLOCATE, "r0", [7], 1, 0, 0, False), (ALLOCATE, "r1", [8], 1, 5, 0, False)], prompts
    )
    assert list(reply.statuses) == [pb.ALLOCATE_STATUS_OK] * 2
    # r1: 4 tokens + 5 lookahead slots = 3 blocks of 4, two of them new.
    assert list(reply.num_new_blocks) == [0, 2]


def test_a_decode_step_with_rejected_drafts_takes_them_back() -> None:
    prompts = {"r0": [1, 2, 3], "r1": [4, 5, 6, 7, 8, 9]}
    reply = _both_paths(
        [(ALLOCATE, "r0", [7], 1, 0, 0, False), (ALLOCATE, "r1", [8], 1, 0, 2, False)], prompts
    )
    assert list(reply.num_computed_tokens) == [4, 5]


def test_a_decode_step_whose_first_operation_gets_no_space_says_so() -> None:
    # 23 usable blocks of 4 tokens: r0 fills its block, r1 has room in its own, and the
    # other two hold every other block. r0's next token needs a block; r1's does not.
    prompts = {
        "r0": [1, 2, 3, 4],
        "r1": [5, 6],
        "filler-a": list(range(100, 164)),
        "filler-b": list(range(200, 220)),
    }
    reply = _both_paths(
        [(ALLOCATE, "r0", [7], 1, 0, 0, False), (ALLOCATE, "r1", [8], 1, 0, 0, False)], prompts
    )
    assert list(reply.statuses) == [pb.ALLOCATE_STATUS_NO_SPACE, pb.ALLOCATE_STATUS_OK]
    assert list(reply.num_scheduled_tokens) == [0, 1]


def test_a_steps_outcomes_are_counted_as_they_were_answered() -> None:
    # apply_step, as the server runs it (the pool's metrics): 23 usable blocks of 4
    # tokens, all held; r0's next token needs a block, r1's and r2's do not. Of the three
    # allocations, two are counted OK and one NO_SPACE.
    pool = make_pool()
    _admit(
        (pool,),
        {
            "r0": [1, 2, 3, 4],
            "r1": [5, 6],
            "r2": [9, 10],
            "filler-a": list(range(100, 164)),
            "filler-b": list(range(200, 216)),
        },
    )
    counters = EngineCounters()
    ops = [(ALLOCATE, rid, [7], 1, 0, 0, False) for rid in ("r0", "r1", "r2")]
    results = apply_step(pool, build(ops), counters)
    assert results.statuses == [
        pb.ALLOCATE_STATUS_NO_SPACE,
        pb.ALLOCATE_STATUS_OK,
        pb.ALLOCATE_STATUS_OK,
    ]
    assert (counters.allocate_ok, counters.allocate_no_space) == (2, 1)
