"""PoolKVCache bounds and safe retries (issue 9, "Hardening").

* max_model_len holds for continuations however their tokens come (packed or not, general
  or fast path), and for lookups;
* ``max_requests`` bounds live requests (ResourceExhausted, nothing changed);
* multimodal items must lie inside the prompt, and are bounded in number and id bytes;
* an admission repeated exactly before the request's next call answers its state again;
  a free of a recently freed id succeeds with nothing freed.
"""

from __future__ import annotations

import array
from typing import Any

import pytest
from core_factories import (
    check_pool_invariants,
    free_order,
    full_config,
    full_spec,
    make_config,
    sliding_spec,
)

from kvsvc.core import (
    MAX_MM_IDENTIFIER_BYTES,
    MAX_MM_ITEMS,
    HashingContext,
    MultiModalItem,
    PoolKVCache,
    RequestStart,
    RunningColumns,
)
from kvsvc.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

START = RequestStart()
MAX_MODEL_LEN = 64


def make_pool(num_blocks: int = 33, **kwargs: Any) -> PoolKVCache:
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    kwargs.setdefault("hash_seed", "seed")
    return PoolKVCache(full_config(4, num_blocks), **kwargs)


def snapshot(pool: PoolKVCache) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    blocks = pool.manager.block_pool
    return (
        free_order(blocks),
        list(blocks.ref_cnt),
        list(blocks.block_hash),
        {rid: pool.block_table(rid) for rid in pool.request_ids()},
        {rid: list(pool._requests[rid].block_hashes) for rid in pool.request_ids()},
        pool.usage(),
        len(pool.manager.events.pending) if pool.manager.events else 0,
    )


def packed(tokens: list[int]) -> tuple[array.array[int], bytes]:
    values = array.array("I", tokens)
    return values, values.tobytes()


# -- max_model_len on continuations -----------------------------------------------------------


@pytest.mark.parametrize("form", ["packed", "list"])
def test_a_continuation_past_max_model_len_is_refused_however_it_is_sent(form: str) -> None:
    """Regression: the packed form (the typed client packs 16+ tokens) skipped the check;
    ``allocate("r", [5]*3000, 1)`` grew a live request to 3,020 tokens past 2,048."""
    pool = make_pool()
    assert pool.allocate("r", list(range(20)), 20, start=START).ok
    before = snapshot(pool)
    extra = [5] * (MAX_MODEL_LEN - 20 + 1)
    with pytest.raises(InvalidArgument, match="max_model_len=64") as err:
        if form == "packed":
            tokens, raw = packed(extra)
            pool.allocate("r", tokens, 1, packed_token_ids=raw)
        else:
            pool.allocate("r", extra, 1)
    assert err.value.field == "new_token_ids"
    assert snapshot(pool) == before
    # Up to the bound is fine.
    tokens, raw = packed(extra[:-1])
    assert pool.allocate("r", tokens, 1, packed_token_ids=raw).ok
    assert pool.block_table("r").num_tokens == MAX_MODEL_LEN


def test_the_fast_path_refuses_multi_token_continuations_past_max_model_len() -> None:
    pool = make_pool()
    assert pool.allocate("r", list(range(60)), 60, start=START).ok
    before = snapshot(pool)
    out = RunningColumns(1)
    pool.allocate_running(["r"], [1] * 5, [5], [1], 0, 1, 0, out)
    assert isinstance(out.errors[0], InvalidArgument)
    assert "max_model_len" in str(out.errors[0])
    assert snapshot(pool) == before


# -- max_requests ------------------------------------------------------------------------------


def test_admissions_beyond_max_requests_are_refused_and_change_nothing() -> None:
    pool = make_pool(max_requests=2)
    assert pool.allocate("a", [1, 2, 3], 3, start=START).ok
    assert pool.allocate("b", [4, 5, 6], 3, start=START).ok
    before = snapshot(pool)
    with pytest.raises(ResourceExhausted, match=r"max_requests=2") as err:
        pool.allocate("c", [7, 8, 9], 3, start=START)
    assert "2 live requests" in str(err.value)
    assert snapshot(pool) == before
    assert not pool.has_request("c")
    # A retried admission of a live request is no new request: it is answered.
    assert pool.allocate("b", [4, 5, 6], 3, start=START).ok
    # Continuations are not admissions.
    assert pool.allocate("a", [4], 1).ok
    pool.free(["a"])
    assert pool.allocate("c", [7, 8, 9], 3, start=START).ok


def test_max_requests_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_requests"):
        make_pool(max_requests=0)


# -- multimodal items --------------------------------------------------------------------------


def mm(*items: tuple[str, int, int]) -> HashingContext:
    return HashingContext(mm_items=tuple(MultiModalItem(*item) for item in items))


@pytest.mark.parametrize(
    ("context", "message"),
    [
        (mm(("img", 2, 10**9)), "runs past the prompt's 10 tokens"),
        (mm(("img", 10, 1)), "runs past the prompt's 10 tokens"),
        (mm(("a", 0, 2), ("b", 5, 6)), r"mm_items\[1\]: offset 5 \+ length 6"),
        (mm(("x" * (MAX_MM_IDENTIFIER_BYTES + 1), 0, 2)), f"{MAX_MM_IDENTIFIER_BYTES} bytes"),
        (mm(("\u00e9" * (MAX_MM_IDENTIFIER_BYTES // 2 + 1), 0, 2)), "bytes"),
        (mm(("", 0, 2)), "identifier"),
        (mm(("img", -1, 2)), "offset >= 0"),
        (mm(("img", 0, 0)), "length > 0"),
        (mm(*((f"i{i}", 0, 1) for i in range(MAX_MM_ITEMS + 1))), f"limit of {MAX_MM_ITEMS}"),
    ],
    ids=["huge", "at-end", "second", "id-ascii", "id-bytes", "id-empty", "neg", "zero", "count"],
)
def test_multimodal_items_must_lie_inside_the_prompt(context: HashingContext, message: str) -> None:
    """Regression: an item of length 10^9, or starting past the prompt, was accepted."""
    pool = make_pool()
    before = snapshot(pool)
    prompt = list(range(10))
    with pytest.raises(InvalidArgument, match=message) as err:
        pool.allocate("r", prompt, 10, start=RequestStart(hashing=context))
    assert err.value.field.startswith("start.hashing.mm_items")
    with pytest.raises(InvalidArgument, match=message) as err:
        pool.lookup(prompt, context)
    assert err.value.field.startswith("hashing.mm_items")
    assert snapshot(pool) == before


def test_multimodal_items_inside_the_prompt_pass() -> None:
    pool = make_pool()
    context = mm(("a", 0, 2), ("b", 4, 6))
    assert pool.allocate("r", list(range(10)), 10, start=RequestStart(hashing=context)).ok
    assert pool.lookup([*range(10), 1], context) == 8
    # As many items as the limit (the count is refused past it, not at it).
    at_limit = mm(*((f"i{i}", 0, 1) for i in range(MAX_MM_ITEMS)))
    assert pool.allocate("s", list(range(10)), 10, start=RequestStart(hashing=at_limit)).ok


# -- lookup ------------------------------------------------------------------------------------


def test_a_lookup_longer_than_max_model_len_is_refused() -> None:
    pool = make_pool()
    with pytest.raises(InvalidArgument, match="max_model_len=64") as err:
        pool.lookup([1] * (MAX_MODEL_LEN + 1))
    assert err.value.field == "token_ids"
    assert pool.lookup([1] * MAX_MODEL_LEN) == 0


@pytest.mark.parametrize("hash_algo", ["xxh3_128", "sha256_cbor"])
def test_prepared_lookups_answer_as_lookup_does(hash_algo: str) -> None:
    """The hash-then-probe split (the server hashes outside its lock) changes no answer."""
    full, window = full_spec(4), sliding_spec(4, 8)
    for pool in (
        make_pool(hash_algo=hash_algo),
        PoolKVCache(make_config(40, full, window), max_model_len=64, hash_algo=hash_algo),
    ):
        context = HashingContext(cache_salt="s", mm_items=(MultiModalItem("img", 3, 4),))
        assert pool.allocate("a", list(range(30)), 30, start=START).ok
        assert pool.allocate("b", list(range(30)), 30, start=RequestStart(hashing=context)).ok
        for tokens, hashing in [
            (list(range(30)), None),
            (list(range(17)), None),
            (list(range(30)), context),
            ([*range(12), 99, 98, 97, 96, 95], None),
            ([1], None),
            ([], None),
        ]:
            hit, blocks = pool.probe_lookup(pool.prepare_lookup(tokens, hashing))
            packed_tokens = array.array("I", tokens)
            assert (hit, blocks) == pool.lookup_blocks(tokens, hashing)
            assert hit == pool.lookup(packed_tokens, hashing)
        assert pool.usage().queries == 60  # the admissions only: lookups count nothing
        check_pool_invariants(
            pool.manager.block_pool,
            [t for rid in pool.request_ids() for t in pool.block_table(rid).groups],
        )


# -- safe retries: admissions ------------------------------------------------------------------


def test_a_repeated_admission_answers_the_requests_state_and_changes_nothing() -> None:
    pool = make_pool()
    assert pool.allocate("warm", list(range(12)), 12, start=START).ok
    prompt = [*range(8), 50, 51, 52, 53, 54]
    first = pool.allocate("r", prompt, 9, start=START)
    assert first.ok and first.num_cached_tokens == 8 and first.num_scheduled_tokens == 5
    before = snapshot(pool)
    for tokens, raw in ((prompt, None), packed(prompt)):
        again = pool.allocate("r", tokens, 9, start=START, packed_token_ids=raw)
        assert again == first
        assert snapshot(pool) == before


def test_a_repeated_admission_that_differs_is_already_exists() -> None:
    pool = make_pool()
    prompt = list(range(10))
    assert pool.allocate("r", prompt, 10, start=START).ok
    before = snapshot(pool)
    for call in (
        lambda: pool.allocate("r", [*prompt[:-1], 77], 10, start=START),
        lambda: pool.allocate("r", prompt[:-1], 10, start=START),
        lambda: pool.allocate("r", prompt, 9, start=START),
        lambda: pool.allocate("r", prompt, 10, 2, start=START),
        lambda: pool.allocate("r", prompt, 10, start=RequestStart(resumed=True)),
        lambda: pool.allocate("r", prompt, 10, start=RequestStart(hashing=mm(("i", 0, 2)))),
    ):
        with pytest.raises(AlreadyExists, match="already live"):
            call()
        assert snapshot(pool) == before


@pytest.mark.parametrize("path", ["general", "fast"])
def test_after_a_continuation_a_repeated_admission_is_already_exists(path: str) -> None:
    pool = make_pool()
    prompt = list(range(10))
    assert pool.allocate("r", prompt, 10, start=START).ok
    if path == "general":
        assert pool.allocate("r", [3, 4], 2).ok
    else:
        out = RunningColumns(1)
        pool.allocate_running(["r"], [3], [1], [1], 0, 1, 0, out)
        assert out.ok == [True] and not out.errors
    before = snapshot(pool)
    with pytest.raises(AlreadyExists, match="called since its admission"):
        pool.allocate("r", prompt, 10, start=START)
    assert snapshot(pool) == before


def test_refused_continuations_keep_the_admission_retryable() -> None:
    """A refused call (NO_SPACE or invalid) changed nothing, the retry marker included."""
    pool = make_pool(num_blocks=4)  # 3 usable blocks of 4 tokens
    first = pool.allocate("r", list(range(8)), 8, start=START)
    assert first.ok
    assert not pool.allocate("r", [], 8).ok  # NO_SPACE
    with pytest.raises(InvalidArgument):
        pool.allocate("r", [-1], 1)
    assert pool.allocate("r", list(range(8)), 8, start=START) == first


def test_a_freed_and_readmitted_request_is_admitted_afresh() -> None:
    pool = make_pool()
    assert pool.allocate("r", list(range(10)), 10, start=START).ok
    pool.free(["r"])
    again = pool.allocate("r", list(range(10)), 10, start=START)
    assert again.ok and again.num_cached_tokens == 8
    assert pool.usage().queries == 20  # two admissions, each counted once


# -- safe retries: free ------------------------------------------------------------------------


def test_a_repeated_free_succeeds_with_nothing_freed() -> None:
    pool = make_pool()
    assert pool.allocate("a", list(range(10)), 10, start=START).ok
    assert pool.allocate("b", list(range(20, 30)), 10, start=START).ok
    assert pool.free(["a"]) == 3
    before = snapshot(pool)
    assert pool.free(["a"]) == 0
    assert snapshot(pool) == before
    # Mixed with a live id: the live one is freed, the repeated one counts as done.
    assert pool.free(["a", "b"]) == 3
    assert pool.usage().num_requests == 0
    # Never seen: NOT_FOUND, and nothing freed even beside a live id.
    assert pool.allocate("c", [1, 2, 3], 3, start=START).ok
    before = snapshot(pool)
    with pytest.raises(NotFound):
        pool.free(["c", "ghost"])
    assert snapshot(pool) == before


def test_preemption_counts_only_requests_really_freed() -> None:
    pool = make_pool()
    assert pool.allocate("a", [1, 2, 3], 3, start=START).ok
    pool.free(["a"], preempted=True)
    pool.free(["a"], preempted=True)
    assert pool.usage().num_preemptions == 1


def test_recently_freed_ids_are_bounded_and_forgotten_oldest_first() -> None:
    pool = make_pool(recently_freed=2)
    for rid in ("a", "b", "c"):
        assert pool.allocate(rid, [1, 2, 3], 3, start=START).ok
        pool.free([rid])
    assert pool.free(["b", "c"]) == 0
    with pytest.raises(NotFound):
        pool.free(["a"])
    off = make_pool(recently_freed=0)
    assert off.allocate("a", [1], 1, start=START).ok
    off.free(["a"])
    with pytest.raises(NotFound):
        off.free(["a"])


def test_a_readmitted_id_is_live_again_not_recently_freed() -> None:
    pool = make_pool()
    assert pool.allocate("a", list(range(10)), 10, start=START).ok
    pool.free(["a"])
    assert pool.allocate("a", list(range(10)), 10, start=START).ok
    assert pool.free(["a"]) == 3  # the live request is freed: all its blocks
    assert pool.free(["a"]) == 0
    assert pool.usage().num_requests == 0
