"""What an engine that schedules ahead (vLLM's async scheduling) or speculates needs from
a pool, exactly as vLLM's own manager does it:

- ``cache_outputs`` (vLLM's ``cache_blocks`` from ``update_from_output``): outputs that
  arrive after their slots are appended, drafts the verifier rejected are taken off, and
  blocks are cached only up to ``computed - in_flight``: a slot a later step still
  writes, or one holding a rejected draft's KV, is never indexed;
- ``num_in_flight_tokens`` on an allocation: out-of-window blocks are freed only below
  ``computed - in_flight`` (vLLM's processed-token basis);
- ``num_draft_tokens`` on an admission: vLLM pads a resumed request with one token left
  to ``1 + drafts``;
- ``max_cache_hit_tokens``: vLLM's ``max_cache_hit_length`` caps an admission's hit.

Block size 4 throughout; "known" tokens are the ones the pool has been sent.
"""

from __future__ import annotations

import pytest

from kvsvc.core import NULL_BLOCK_ID, PoolKVCache, RequestStart
from kvsvc.core.hashing import HashingContext
from kvsvc.errors import InvalidArgument
from tests.core.core_factories import full_config, make_config, sliding_spec

pytestmark = pytest.mark.pure_build

BLOCK = 4


def _pool(num_blocks: int = 32, *, window: int | None = None) -> PoolKVCache:
    config = (
        make_config(num_blocks, sliding_spec(BLOCK, window))
        if window is not None
        else full_config(BLOCK, num_blocks)
    )
    return PoolKVCache(config, max_model_len=256, hash_algo="sha256_cbor", enable_events=True)


def _hit(pool: PoolKVCache, tokens: list[int]) -> int:
    return pool.lookup([*tokens, 999])


def test_outputs_are_cached_only_below_the_tokens_in_flight() -> None:
    pool = _pool()
    prompt = list(range(10, 17))  # 7 tokens: block 0 full
    assert pool.allocate("r", prompt, 7, start=RequestStart()).ok
    # An async step is scheduled before the previous output arrives: computed 8, known 7.
    assert pool.allocate("r", [], 1).ok
    # The first step's output arrives (token at position 7) while the second is in flight:
    # block 1 (positions 4..7) is full of known tokens, but position 7's KV is being
    # written by the step in flight: vLLM caches up to computed - in flight = 7.
    out = pool.cache_outputs("r", [17], num_in_flight_tokens=1)
    assert out.ok and out.new_block_ids == ([],) and out.num_computed_tokens == 8
    assert _hit(pool, [*prompt, 17]) == 4
    # The second step's output arrives; nothing in flight any more: block 1 is cached.
    pool.cache_outputs("r", [18], num_in_flight_tokens=0)
    assert _hit(pool, [*prompt, 17]) == 8


def test_a_block_whose_last_slot_held_a_rejected_draft_is_never_cached() -> None:
    pool = _pool()
    prompt = list(range(20, 29))  # positions 0..8
    assert pool.allocate("r", prompt, 9, start=RequestStart()).ok
    # A decode with 3 drafts: the sampled token at 9, drafts at 10, 11, 12: computed 13.
    assert pool.allocate("r", [29], 4).ok
    # The verifier accepts the draft at 10 and samples a bonus token for 11, whose slot
    # holds the rejected draft's KV: 2 rejected, computed back to 11, known 12. Block 2
    # (8..11) is full of known tokens, but slot 11 is not valid yet: not cached.
    out = pool.cache_outputs("r", [30, 31], num_rejected_tokens=2)
    assert out.num_computed_tokens == 11
    assert _hit(pool, [*prompt, 29, 30, 31]) == 8
    # The next step computes slot 11 again: now block 2 is cached.
    assert pool.allocate("r", [], 1).ok
    assert _hit(pool, [*prompt, 29, 30, 31]) == 12


def test_cache_outputs_refuses_bad_counts_and_changes_nothing() -> None:
    pool = _pool()
    assert pool.allocate("r", [1, 2, 3, 4, 5], 5, start=RequestStart()).ok
    before = pool.request_state("r")
    assert before is not None
    tokens_before = list(before.all_token_ids)
    with pytest.raises(InvalidArgument, match="num_in_flight_tokens"):
        pool.cache_outputs("r", [6], num_in_flight_tokens=6)
    with pytest.raises(InvalidArgument, match="num_rejected_tokens"):
        pool.cache_outputs("r", [6], num_rejected_tokens=6)
    with pytest.raises(InvalidArgument, match="num_in_flight_tokens"):
        pool.cache_outputs("r", [6], num_in_flight_tokens=-1)
    state = pool.request_state("r")
    assert state is not None
    assert list(state.all_token_ids) == tokens_before and state.num_computed_tokens == 5


def test_window_blocks_in_flight_are_not_freed() -> None:
    """A window of 4 tokens: at computed 12 the blocks before position 8 are out of it;
    with 8 tokens in flight only the ones before position 4 are (vLLM frees on the
    processed-token basis: the steps in flight still read them)."""

    def table_after(in_flight: int) -> list[int]:
        pool = _pool(window=4)
        assert pool.allocate("r", list(range(8)), 8, start=RequestStart()).ok
        assert pool.allocate("r", [8], 4).ok  # computed 12
        assert pool.allocate("r", [], 1, num_in_flight_tokens=in_flight).ok
        return pool.block_table("r").groups[0]

    synchronous = table_after(0)
    ahead = table_after(8)
    assert synchronous[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert ahead[0] == NULL_BLOCK_ID and ahead[1] != NULL_BLOCK_ID


def test_an_admission_is_padded_with_its_drafts() -> None:
    pool = _pool()
    prompt = list(range(40, 49))  # 9 tokens: 8 cached after the first request
    assert pool.allocate("a", prompt, 9, start=RequestStart()).ok
    pool.free(["a"])
    out = pool.allocate("b", prompt, 4, start=RequestStart(num_draft_tokens=3))
    assert out.ok
    assert out.num_cached_tokens == 8
    assert out.num_scheduled_tokens == 4  # the last prompt token + 3 drafts
    assert out.num_computed_tokens == 12
    with pytest.raises(InvalidArgument, match="num_draft_tokens"):
        pool.allocate("c", prompt, 2, start=RequestStart(num_draft_tokens=3))
    assert not pool.has_request("c")


def test_an_admission_hit_is_capped() -> None:
    pool = _pool()
    prompt = list(range(60, 73))  # 13 tokens: 12 cacheable
    assert pool.allocate("a", prompt, 13, start=RequestStart()).ok
    pool.free(["a"])
    capped = pool.allocate("b", prompt, 13, start=RequestStart(max_cache_hit_tokens=6))
    assert capped.num_cached_tokens == 4  # whole blocks only
    pool.free(["b"])
    none = pool.allocate("c", prompt, 13, start=RequestStart(max_cache_hit_tokens=0))
    assert none.num_cached_tokens == 0
    assert pool.lookup_capped(prompt, None, 9)[0] == 8
    assert pool.lookup_capped(prompt, None, None)[0] == 12


def test_the_adapters_id_reaches_the_events() -> None:
    pool = _pool()
    hashing = HashingContext(lora_name="ad", lora_path="/a", lora_id=7)
    assert pool.allocate("r", list(range(9)), 9, start=RequestStart(hashing=hashing)).ok
    batch = pool.take_events()
    assert batch is not None
    stored = [e for e in batch.events if type(e).__name__ == "BlockStored"]
    assert stored and all(e.lora_id == 7 and e.lora_name == "ad" for e in stored)


def test_a_refused_allocation_releases_the_blocks_its_window_passed() -> None:
    """vLLM frees a running request's out-of-window blocks before it checks for space, so
    they join the free queue even when the allocation fails (ahead of the blocks of the
    request the scheduler then preempts)."""
    pool = _pool(num_blocks=6, window=4)  # 5 usable blocks
    assert pool.allocate("r", list(range(12)), 12, start=RequestStart()).ok  # 3 blocks
    assert pool.allocate("other", [50, 51, 52, 53, 54, 55], 6, start=RequestStart()).ok
    free_before = pool.usage_free_blocks()
    table_before = pool.block_table("r").groups[0]
    assert free_before == 0 and NULL_BLOCK_ID not in table_before[1:]
    # The next 12 tokens need three more blocks; the window (4 tokens) has passed blocks 0
    # and 1, which go back to the queue: two blocks, one short.
    out = pool.allocate("r", [12], 12)
    assert not out.ok and out.released
    assert out.num_computed_tokens == 12
    table = pool.block_table("r").groups[0]
    assert table[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID] and table[2] == table_before[2]
    assert pool.usage_free_blocks() == 2
    state = pool.request_state("r")
    assert state is not None and len(state.all_token_ids) == 12  # its tokens as they were
