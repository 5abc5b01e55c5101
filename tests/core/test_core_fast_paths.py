"""The running-request shortcuts of KVCacheManager behave exactly like the general path."""

from __future__ import annotations

import array
from typing import Any

import pytest
from core_factories import (
    chunked_spec,
    full_spec,
    make_config,
    make_request,
    sliding_spec,
)
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvsvc.core import (
    BlockExtraKeys,
    HashingContext,
    KVCacheManager,
    MultiModalItem,
    PoolKVCache,
    RequestStart,
    RequestState,
    RunningColumns,
)
from kvsvc.errors import KvsvcError
from kvsvc.specs import KVCacheConfig

CONFIGS = {
    "full": make_config(14, full_spec(4)),
    "full+sliding": make_config(22, full_spec(4), sliding_spec(4, 6)),
    "sliding+chunked": make_config(22, sliding_spec(2, 5), chunked_spec(2, 8)),
}


def build(config: KVCacheConfig, *, shortcuts: bool) -> KVCacheManager:
    manager = KVCacheManager(config, 48, hash_algo="xxh3_128", hash_seed="s")
    if not shortcuts:
        manager._plain_group = None
        manager._windowed_groups = None
    return manager


def state(manager: KVCacheManager) -> tuple[object, ...]:
    pool = manager.block_pool
    return (
        pool.free_queue.get_all_free_blocks(),
        list(pool.ref_cnt),
        list(pool.block_hash),
        [dict(m.req_to_blocks) for m in manager.coordinator.managers],
        [dict(m.num_cached_block) for m in manager.coordinator.managers],
    )


@settings(deadline=None, max_examples=150)
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=40,
    ),
)
def test_shortcuts_match_the_general_path(name: str, ops: list[tuple[int, int, int, bool]]) -> None:
    config = CONFIGS[name]
    fast = build(config, shortcuts=True)
    slow = build(config, shortcuts=False)
    assert fast._plain_group is not None or fast._windowed_groups is not None
    requests: dict[str, tuple[RequestState, RequestState]] = {}
    for slot, num_new, lookahead, finish in ops:
        rid = f"r{slot}"
        if rid not in requests:
            prompt = [slot % 2] * 5 + list(range(num_new))
            pair = (make_request(fast, rid, prompt), make_request(slow, rid, prompt))
            outcomes = []
            for manager, request in zip((fast, slow), pair, strict=True):
                hits, num_hits = manager.get_computed_blocks(request)
                blocks = manager.allocate_slots(
                    request, request.num_tokens - num_hits, num_hits, hits, lookahead
                )
                if blocks is not None:
                    request.num_computed_tokens = request.num_tokens
                outcomes.append(None if blocks is None else blocks.get_block_ids())
            assert outcomes[0] == outcomes[1]
            if outcomes[0] is not None:
                requests[rid] = pair
        elif finish:
            for manager, request in zip((fast, slow), requests.pop(rid), strict=True):
                manager.free(request)
        else:
            outcomes = []
            for manager, request in zip((fast, slow), requests[rid], strict=True):
                if request.num_tokens + num_new + lookahead > 44:
                    continue
                request.append_token_ids([7] * num_new)
                blocks = manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                if blocks is None:
                    request.truncate(request.num_tokens - num_new)
                else:
                    request.num_computed_tokens += num_new
                outcomes.append(None if blocks is None else blocks.get_block_ids())
            if outcomes:
                assert outcomes[0] == outcomes[1]
        assert state(fast) == state(slow)


@pytest.mark.patches_core
def test_the_shortcuts_are_taken_and_refusals_happen() -> None:
    """Guard for the property test above: its sequences do reach both shortcuts and NO_SPACE."""
    import random

    for name in CONFIGS:
        rng = random.Random(name)
        manager = build(CONFIGS[name], shortcuts=True)
        taken = {"shortcut": 0, "refused": 0}
        for attr in ("_allocate_running_plain", "_allocate_running_windowed"):
            original = getattr(manager, attr)

            def counted(
                *args: object, _original: object = original, _taken: dict[str, int] = taken
            ) -> object:
                _taken["shortcut"] += 1
                return _original(*args)  # type: ignore[operator]

            setattr(manager, attr, counted)
        live: list[RequestState] = []
        for step in range(300):
            if len(live) < 3:
                request = make_request(manager, f"r{step}", [1] * rng.randrange(1, 12))
                hits, num_hits = manager.get_computed_blocks(request)
                if manager.allocate_slots(request, request.num_tokens - num_hits, num_hits, hits):
                    request.num_computed_tokens = request.num_tokens
                    live.append(request)
            elif rng.random() < 0.1:
                manager.free(live.pop(rng.randrange(len(live))))
            else:
                request = rng.choice(live)
                if request.num_tokens > 40:
                    manager.free(request)
                    live.remove(request)
                    continue
                request.append_token_ids([2, 3])
                if manager.allocate_slots(request, 2, num_lookahead_tokens=rng.randrange(3)):
                    request.num_computed_tokens += 2
                else:
                    request.truncate(request.num_tokens - 2)
                    taken["refused"] += 1
        assert taken["shortcut"] > 50 and taken["refused"] > 0, (name, taken)


# -- PoolKVCache.allocate_running (the Step fast path) against allocate, one call each -------

# A small max_model_len so decodes reach the bound, and contexts whose extra keys reach the
# blocks that decode steps complete: LoRA keys every block, a multimodal item ending in a
# prompt's last, partial block keys the block a decode completes, prompt-embeds digests run
# past short prompts, the salt keys only the first block. (An item past the prompt's end is
# refused on both paths.)
MAX_MODEL_LEN = 16
FAST_BLOCK_SIZE = 4
HASHING_CONTEXTS: list[HashingContext | None] = [
    None,
    HashingContext(cache_salt="tenant-a"),
    HashingContext(lora_name="adapter-a", lora_path="/lora/a"),
    HashingContext(lora_name="adapter-b", lora_path="/lora/b"),
    HashingContext(mm_items=(MultiModalItem("image-0", 2, 4),)),
    HashingContext(prompt_embeds_digests=(b"e0", b"e1", b"e2", b"e3")),
    HashingContext(
        cache_salt="tenant-b",
        lora_name="adapter-a",
        lora_path="/lora/a",
        mm_items=(MultiModalItem("image-1", 1, 2), MultiModalItem("image-2", 4, 2)),
        prompt_embeds_digests=(b"f0", b"f1"),
    ),
]
FAST_REQUESTS = [f"q{i}" for i in range(3)]


def make_fast_pool(
    hash_algo: str, max_tokens: int | None = None, max_unscheduled_tokens: int | None = None
) -> PoolKVCache:
    return PoolKVCache(
        make_config(14, full_spec(FAST_BLOCK_SIZE)),
        max_model_len=MAX_MODEL_LEN,
        hash_algo=hash_algo,
        hash_seed="seed",
        max_tokens=max_tokens,
        max_unscheduled_tokens=max_unscheduled_tokens,
    )


def expected_hashes(pool: PoolKVCache, rid: str) -> list[bytes]:
    """The request's chain recomputed block by block from its tokens and context."""
    request = pool._requests[rid]
    hasher = pool.manager.hasher
    assert hasher is not None
    extra = (
        BlockExtraKeys(request.hashing, hasher.block_size)
        if request.hashing is not None and not request.hashing.is_empty
        else None
    )
    tokens = list(request.all_token_ids)
    size = hasher.block_size
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - size + 1, size):
        keys = extra(start, start + size) if extra is not None else None
        hashes.append(
            hasher.hash_block(hashes[-1] if hashes else None, tokens[start : start + size], keys)
        )
    return hashes


def pool_state(pool: PoolKVCache) -> tuple[object, ...]:
    blocks = pool.manager.block_pool
    return (
        blocks.free_queue.get_all_free_blocks(),
        list(blocks.ref_cnt),
        list(blocks.block_hash),
        {rid: pool.block_table(rid) for rid in pool.request_ids()},
        {rid: list(pool._requests[rid].block_hashes) for rid in pool.request_ids()},
        pool.usage(),
    )


# Operations ahead of the batch in its Step (an admission's, say), which allocate_running
# is not asked to apply: the batch's operations and tokens start after theirs, as a decode
# run does after other operations in a Step.
LEAD_OPS = [("lead-a", [9, 9, 9], 3), ("lead-b", [9], 1)]


def run_fast(pool: PoolKVCache, ops: list[tuple[str, list[int], int]]) -> list[tuple[object, ...]]:
    """One allocate_running call for the whole batch (as a Step's decode run is applied),
    the batch placed after :data:`LEAD_OPS` in the Step's columns."""
    step = LEAD_OPS + ops
    lead = len(LEAD_OPS)
    out = RunningColumns(len(step))
    tokens = [t for _, toks, _ in step for t in toks]
    token_pos = sum(len(toks) for _, toks, _ in LEAD_OPS)
    end = pool.allocate_running(
        [rid for rid, _, _ in step],
        array.array("I", tokens) if tokens and min(tokens) >= 0 else tokens,
        [len(toks) for _, toks, _ in step],
        [num_new for _, _, num_new in step],
        lead,
        len(step),
        token_pos,
        out,
    )
    assert end == len(tokens)
    results: list[tuple[object, ...]] = []
    for i in range(lead, len(step)):
        error = out.errors.get(i)
        if error is not None:
            results.append(("error", type(error), str(error)))
        else:
            results.append((out.ok[i], out.num_computed_tokens[i], list(out.new_block_ids[i])))
    return results


def run_general(
    pool: PoolKVCache, ops: list[tuple[str, list[int], int]]
) -> list[tuple[object, ...]]:
    """The same operations, one ``allocate`` each (the general path)."""
    results: list[tuple[object, ...]] = []
    for rid, toks, num_new in ops:
        try:
            outcome = pool.allocate(rid, toks, num_new)
        except KvsvcError as exc:
            results.append(("error", type(exc), str(exc)))
            continue
        results.append((outcome.ok, outcome.num_computed_tokens, list(outcome.new_block_ids[0])))
    return results


admission = st.tuples(
    st.just("admit"),
    st.sampled_from(FAST_REQUESTS),
    # Lengths drawn uniformly (not hypothesis's short-list bias) so decodes reach the bound.
    st.integers(1, MAX_MODEL_LEN - 1).flatmap(
        lambda n: st.lists(st.integers(0, 3), min_size=n, max_size=n)
    ),
    st.integers(0, MAX_MODEL_LEN),
    st.integers(0, len(HASHING_CONTEXTS) - 1),
)
decode_batch = st.tuples(
    st.just("decode"),
    st.lists(
        st.tuples(
            st.sampled_from(FAST_REQUESTS),
            # Mostly one sampled token and one slot; sometimes no token (a prefill chunk),
            # two (the general path inside allocate_running), a bad id or a bad count.
            st.one_of(
                st.lists(st.integers(0, 3), min_size=1, max_size=1),
                st.lists(st.integers(0, 3), min_size=1, max_size=1),
                st.lists(st.integers(0, 3), min_size=1, max_size=1),
                st.lists(st.integers(-1, 3), max_size=2),
            ),
            st.sampled_from([1, 1, 1, 1, 1, 1, 0, 2, 3, -1]),
        ),
        min_size=1,
        max_size=8,
    ),
)
release = st.tuples(st.just("free"), st.sampled_from(FAST_REQUESTS))


@settings(deadline=None, max_examples=300)
@given(
    hash_algo=st.sampled_from(["xxh3_128", "sha256_cbor"]),
    admissions=st.lists(admission, min_size=1, max_size=len(FAST_REQUESTS)),
    steps=st.lists(
        st.one_of(admission, admission, decode_batch, decode_batch, decode_batch, release),
        min_size=4,
        max_size=30,
    ),
)
def test_allocate_running_matches_allocate_with_hashing_contexts(
    hash_algo: str, admissions: list[tuple[Any, ...]], steps: list[tuple[Any, ...]]
) -> None:
    """Same outcomes, errors, tables, hashes, free queue, usage and events on both paths.

    Prompts are packed (the wire's form), so xxh3 pools take the fast path's one-block
    hashing shortcut; the chain is also checked against a block-by-block recomputation with
    the request's extra keys, and no request ever passes max_model_len. The tokens held are
    bounded (at twice max_model_len, so both paths meet the bound) and counted alike.
    """
    bound, unscheduled_bound = 2 * MAX_MODEL_LEN, MAX_MODEL_LEN
    fast, general = (
        make_fast_pool(hash_algo, bound, unscheduled_bound),
        make_fast_pool(hash_algo, bound, unscheduled_bound),
    )
    for step in admissions + steps:
        if step[0] == "admit":
            _, rid, prompt, budget, context = step
            if fast.has_request(rid):
                continue
            start = RequestStart(hashing=HASHING_CONTEXTS[context])
            admitted: list[tuple[object, ...]] = []
            for pool in (fast, general):
                tokens = array.array("I", prompt)
                try:
                    outcome = pool.allocate(
                        rid, tokens, budget, 0, start, packed_token_ids=tokens.tobytes()
                    )
                except KvsvcError as exc:
                    admitted.append(("error", type(exc), str(exc)))
                    continue
                admitted.append((outcome.ok, outcome.new_block_ids, outcome.num_cached_tokens))
            assert admitted[0] == admitted[1]
        elif step[0] == "decode":
            results = run_fast(fast, step[1])
            assert results == run_general(general, step[1]), step
            for result in results:
                # Coverage, shown by --hypothesis-show-statistics.
                if result[0] == "error" and "max_model_len" in str(result[2]):
                    event("refused at max_model_len")
                elif result[0] == "error" and "max_pool_tokens" in str(result[2]):
                    event("refused at max_pool_tokens")
                elif result[0] == "error" and "max_unscheduled_tokens" in str(result[2]):
                    event("refused at max_unscheduled_tokens")
                elif result[1] == MAX_MODEL_LEN:
                    event("reached max_model_len")
        elif fast.has_request(step[1]):
            fast.free([step[1]])
            general.free([step[1]])
        assert pool_state(fast) == pool_state(general), step
        fast_events, general_events = fast.take_events(), general.take_events()
        assert (fast_events and fast_events.events) == (general_events and general_events.events)
        assert fast.num_tokens_held == general.num_tokens_held
        assert fast.num_tokens_held == sum(r.num_tokens for r in fast._requests.values())
        assert fast.num_tokens_held <= bound
        assert fast.num_tokens_unscheduled == general.num_tokens_unscheduled
        assert fast.num_tokens_unscheduled == sum(
            max(0, r.num_tokens - r.num_computed_tokens) for r in fast._requests.values()
        )
        assert fast.num_tokens_unscheduled <= unscheduled_bound
        for rid in fast.request_ids():
            request = fast._requests[rid]
            assert request.num_tokens <= MAX_MODEL_LEN
            assert request.num_computed_tokens <= MAX_MODEL_LEN
            assert list(request.block_hashes) == expected_hashes(fast, rid), rid


@pytest.mark.parametrize(
    "context", HASHING_CONTEXTS[1:], ids=["salt", "lora-a", "lora-b", "mm", "embeds", "all"]
)
def test_decode_blocks_carry_the_requests_extra_keys(context: HashingContext) -> None:
    """Blocks completed by fast-path decodes hash with the request's extra keys.

    Regression guard: hashing a decode block without them makes an adapter's (or another
    tenant's, or another image's) KV a hit for requests that must not share it.
    """
    pool = make_fast_pool("xxh3_128")
    prompt = array.array("I", [1, 2, 3, 0, 1, 2])
    assert pool.allocate(
        "r", prompt, 6, 0, RequestStart(hashing=context), packed_token_ids=prompt.tobytes()
    ).ok
    for token in [3, 0, 1, 2, 3, 0]:  # completes blocks 1 and 2 one token at a time
        assert run_fast(pool, [("r", [token], 1)])[0][0] is True
    assert len(pool._requests["r"].block_hashes) == 3
    assert list(pool._requests["r"].block_hashes) == expected_hashes(pool, "r")


def test_decodes_stop_at_max_model_len() -> None:
    """The fast path refuses the token past max_model_len, as ``allocate`` does, and keeps
    nothing of it."""
    pool = make_fast_pool("xxh3_128")
    prompt = array.array("I", range(MAX_MODEL_LEN - 2))
    assert pool.allocate(
        "r", prompt, len(prompt), 0, RequestStart(), packed_token_ids=prompt.tobytes()
    ).ok
    assert run_fast(pool, [("r", [1], 1), ("r", [2], 1)]) == [
        (True, MAX_MODEL_LEN - 1, []),
        (True, MAX_MODEL_LEN, []),
    ]
    before = pool_state(pool)
    # A sampled token past the bound (with or without a slot for it) and a slot past it.
    refused = run_fast(pool, [("r", [3], 1), ("r", [3], 0), ("r", [], 1)])
    assert [r[0] for r in refused] == ["error"] * 3
    assert "max_model_len=16" in str(refused[0][2]) and "max_model_len=16" in str(refused[2][2])
    assert refused == run_general(pool, [("r", [3], 1), ("r", [3], 0), ("r", [], 1)])
    assert pool_state(pool) == before
