"""Random operation sequences against plain reference models, invariants after every step.

Two machines:

- ``PoolMachine`` drives the block pool (allocate, free, touch, cache, evict, reset) next to
  the reference's design written as plainly as possible: one Python list for the free queue
  and dicts for counts and hashes. The pool must match it exactly, eviction order included.
- ``FacadeMachine`` drives ``PoolKVCache`` as an engine would (admit, chunked prefill,
  decode with drafts, free, preempt, reset, evict, lookup) on a pool small enough to run out,
  keeps the engine-side view of each request, and checks the pool's invariants; every
  NO_SPACE must leave the pool exactly as it was, but for the blocks a window passed,
  which vLLM releases before it checks for space (and the outcome says so).
"""

from __future__ import annotations

from typing import Any

from core_factories import check_pool_invariants, full_spec, make_config, sliding_spec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvsvc.core import NULL_BLOCK_ID, BlockPool, HashingContext, PoolKVCache, RequestStart
from kvsvc.core.hashing import hashes_at_block_size
from kvsvc.specs import KVCacheConfig

NUM_BLOCKS = 12
NUM_GROUPS = 2
HASHES = [bytes([i]) * 4 for i in range(6)]


class _ReferencePool:
    """The reference's pool semantics, with a single list as the free queue."""

    def __init__(self, num_blocks: int) -> None:
        self.queue = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hash: dict[int, tuple[int, bytes]] = {}
        self.index: dict[tuple[int, bytes], list[int]] = {}

    def _drop_hash(self, block_id: int) -> None:
        key = self.hash.pop(block_id, None)
        if key is not None:
            self.index[key].remove(block_id)
            if not self.index[key]:
                del self.index[key]

    def get(self, n: int) -> list[int]:
        ids, self.queue = self.queue[:n], self.queue[n:]
        for b in ids:
            self._drop_hash(b)
            self.ref[b] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for b in ids:
            self.ref[b] -= 1
        freeable = [b for b in ids if self.ref[b] == 0]
        fresh = [b for b in freeable if b not in self.hash]
        cached = [b for b in freeable if b in self.hash]
        self.queue = fresh + self.queue + cached

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1

    def cache(self, block_id: int, group_id: int, block_hash: bytes) -> None:
        self.hash[block_id] = (group_id, block_hash)
        self.index.setdefault((group_id, block_hash), []).append(block_id)

    def reset(self) -> bool:
        if any(self.ref[1:]):
            return False
        self.hash.clear()
        self.index.clear()
        return True


class PoolMachine(RuleBasedStateMachine):
    """The block pool against the single-list reference."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, num_groups=NUM_GROUPS)
        self.model = _ReferencePool(NUM_BLOCKS)
        self.holders: list[list[int]] = []  # each a request-like owner of blocks

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.model.queue)))
        ids = self.pool.get_new_blocks(n)
        assert ids == self.model.get(n)
        if ids:
            self.holders.append(ids)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        holder = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        order = data.draw(st.sampled_from(["tail first", "as is", "shuffled"]))
        if order == "tail first":
            holder = holder[::-1]
        elif order == "shuffled":
            holder = data.draw(st.permutations(holder))
        self.pool.free_blocks(holder)
        self.model.free(list(holder))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        holder = data.draw(st.sampled_from(self.holders))
        block_id = data.draw(st.sampled_from(holder))
        if block_id in self.model.hash:
            return
        group_id = data.draw(st.integers(0, NUM_GROUPS - 1))
        block_hash = data.draw(st.sampled_from(HASHES))
        self.pool.cache_full_blocks([block_id], [block_hash], 0, 1, group_id, 4)
        self.model.cache(block_id, group_id, block_hash)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def cache_duplicates(self, data: st.DataObject) -> None:
        """Several requests compute the same block: one hash on 2+ blocks of one group.

        Random ``cache`` draws rarely make three copies of one hash before an eviction,
        which is what checks that the oldest remaining copy is promoted.
        """
        uncached = sorted({b for holder in self.holders for b in holder} - set(self.model.hash))
        if not uncached:
            return
        ids = data.draw(st.lists(st.sampled_from(uncached), min_size=1, max_size=4, unique=True))
        group_id = data.draw(st.integers(0, NUM_GROUPS - 1))
        block_hash = data.draw(st.sampled_from(HASHES[:2]))
        for block_id in ids:
            self.pool.cache_full_blocks([block_id], [block_hash], 0, 1, group_id, 4)
            self.model.cache(block_id, group_id, block_hash)

    @rule(block_hash=st.sampled_from(HASHES), group_id=st.integers(0, NUM_GROUPS - 1))
    def hit(self, block_hash: bytes, group_id: int) -> None:
        found = self.pool.get_cached_block(block_hash, [group_id])
        expected = self.model.index.get((group_id, block_hash))
        assert found == (expected[:1] if expected else None)
        if found is not None:
            self.pool.touch(found)
            self.model.touch(found)
            self.holders.append(found)

    @rule(ids=st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4))
    def evict(self, ids: list[int]) -> None:
        self.pool.evict_blocks(ids)
        for b in ids:
            self.model._drop_hash(b)

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == self.model.reset()

    @invariant()
    def same_as_reference(self) -> None:
        assert self.pool.free_queue.get_all_free_blocks() == self.model.queue
        assert self.pool.ref_cnt[1:] == self.model.ref[1:]
        for b in range(1, NUM_BLOCKS):
            key = self.model.hash.get(b)
            assert self.pool.block_hash[b] == (key[1] if key else None)
        for (group_id, block_hash), ids in self.model.index.items():
            assert self.pool.cached_blocks_of(block_hash, group_id) == ids
        check_pool_invariants(self.pool, self.holders)


PoolMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


# Prompts share prefixes so that hits, duplicates and evictions all happen.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [6, 6, 6, 6, 6, 6, 6, 6]]


class FacadeMachine(RuleBasedStateMachine):
    """PoolKVCache as an engine drives it, on a pool small enough to run dry."""

    config: KVCacheConfig = make_config(16, full_spec(4))
    max_model_len = 40

    def __init__(self) -> None:
        super().__init__()
        self.pool = PoolKVCache(
            self.config, max_model_len=self.max_model_len, hash_algo="xxh3_128", hash_seed="s"
        )
        # The engine's view: tokens and computed count per live request.
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.salts: dict[str, HashingContext | None] = {}
        self.next_id = 0
        self.no_space = 0

    @initialize()
    def start(self) -> None:
        self.next_id = 0

    def _snapshot(self) -> tuple[Any, ...]:
        blocks = self.pool.manager.block_pool
        return (
            blocks.free_queue.get_all_free_blocks(),
            list(blocks.ref_cnt),
            list(blocks.block_hash),
            {rid: self.pool.block_table(rid) for rid in self.pool.request_ids()},
            self.pool.usage(),
        )

    @rule(
        stem=st.sampled_from(STEMS),
        tail=st.lists(st.integers(0, 50), max_size=14),
        budget=st.integers(0, 24),
        salt=st.sampled_from([None, "t"]),
        lookahead=st.integers(0, 3),
    )
    def admit(
        self, stem: list[int], tail: list[int], budget: int, salt: str | None, lookahead: int
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = stem + tail
        hashing = HashingContext(cache_salt=salt) if salt else None
        expected_hit = self.pool.lookup(prompt, hashing)
        before = self._snapshot()
        out = self.pool.allocate(rid, prompt, budget, lookahead, RequestStart(hashing=hashing))
        assert out.num_cached_tokens == expected_hit
        assert out.num_cached_tokens <= len(prompt) - 1
        assert out.num_cached_tokens % self.pool.block_size == 0
        assert out.num_scheduled_tokens == min(budget, len(prompt) - out.num_cached_tokens)
        if not out.ok:
            self.no_space += 1
            assert not self.pool.has_request(rid)
            assert self._snapshot() == before
            return
        self.tokens[rid] = list(prompt)
        self.computed[rid] = out.num_cached_tokens + out.num_scheduled_tokens
        self.salts[rid] = hashing
        assert out.num_computed_tokens == self.computed[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, computed = self.tokens[rid], self.computed[rid]
        lookahead = data.draw(st.integers(0, 3))
        if computed < len(tokens):  # prefill continues
            new: list[int] = []
            num_new = data.draw(st.integers(1, len(tokens) - computed))
        else:  # decode: the sampled token, maybe with drafts
            if len(tokens) >= self.max_model_len - 4:
                return
            new = [data.draw(st.integers(0, 50))]
            num_new = 1 + data.draw(st.integers(0, 2))
        if computed + num_new > self.max_model_len:
            return
        before = self._snapshot()
        out = self.pool.allocate(rid, new, num_new, lookahead)
        if not out.ok:
            self.no_space += 1
            assert out.num_computed_tokens == computed
            # Nothing changed, but for the blocks a window passed, which vLLM releases
            # before it checks for space (the outcome says so; the request's tokens and
            # computed count stay as they were: engine_view_matches checks them).
            assert out.released == (self._snapshot() != before)
            return
        tokens.extend(new)
        # Drafts beyond the known tokens count as computed until rejected; reject them at
        # once so the engine view stays simple.
        self.computed[rid] = computed + num_new
        if self.computed[rid] > len(tokens):
            extra = self.computed[rid] - len(tokens)
            probe = self.pool.allocate(rid, [], 0, num_rejected_tokens=extra)
            assert probe.ok
            self.computed[rid] = len(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempted=st.booleans())
    def free(self, data: st.DataObject, preempted: bool) -> None:
        rids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), unique=True, min_size=1))
        self.pool.free(rids, preempted=preempted)
        for rid in rids:
            del self.tokens[rid], self.computed[rid], self.salts[rid]

    @rule()
    def reset(self) -> None:
        # Refused while any live request holds a block (one admitted with a zero budget
        # and no hit holds none).
        holding = any(
            b != NULL_BLOCK_ID
            for rid in self.pool.request_ids()
            for table in self.pool.block_table(rid).groups
            for b in table
        )
        assert self.pool.reset_prefix_cache() == (not holding)

    @rule(ids=st.lists(st.integers(0, 15), max_size=3))
    def evict(self, ids: list[int]) -> None:
        self.pool.evict_blocks(ids)

    @invariant()
    def engine_view_matches(self) -> None:
        assert sorted(self.pool.request_ids()) == sorted(self.tokens)
        for rid, tokens in self.tokens.items():
            view = self.pool.block_table(rid)
            assert view.num_tokens == len(tokens)
            assert view.num_computed_tokens == self.computed[rid]
            for group_id, manager in enumerate(self.pool.manager.coordinator.managers):
                table = view.groups[group_id]
                bs = manager.block_size
                assert len(table) >= -(-self.computed[rid] // bs)
                # Every cached block in the table carries this request's own chain hash.
                state = self.pool._requests[rid]
                hashes = hashes_at_block_size(state.block_hashes, self.pool.hash_block_size, bs)
                pool = self.pool.manager.block_pool
                for i, block_id in enumerate(table[: len(hashes)]):
                    if block_id != NULL_BLOCK_ID and pool.block_hash[block_id] is not None:
                        assert pool.block_hash[block_id] == hashes[i]

    @invariant()
    def pool_invariants(self) -> None:
        tables = [t for rid in self.pool.request_ids() for t in self.pool.block_table(rid).groups]
        check_pool_invariants(self.pool.manager.block_pool, tables)


FacadeMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFacadeMachine = FacadeMachine.TestCase


class HybridFacadeMachine(FacadeMachine):
    """The same with full attention (8-token blocks) and a sliding window (4-token blocks)."""

    config = make_config(24, full_spec(8), sliding_spec(4, 6))


HybridFacadeMachine.TestCase.settings = FacadeMachine.TestCase.settings
TestHybridFacadeMachine = HybridFacadeMachine.TestCase


def test_the_facade_machine_runs_out_of_blocks() -> None:
    """Guard against a machine that never reaches NO_SPACE (its checks would be idle)."""
    machine = FacadeMachine()
    for i in range(6):
        machine.admit(STEMS[2], [i] * 10, 18, None, 0)
    assert machine.no_space > 0
    machine.pool_invariants()


def test_duplicate_hashes_promote_the_oldest_remaining_copy() -> None:
    """Three requests compute the same blocks; evicting the first copy promotes the second.

    vLLM's BlockPool keeps a hash's blocks in insertion order and a lookup returns the first
    remaining one (``BlockHashToBlockMap.get_one_block``), so after the oldest copy is
    evicted the next admission must hit the second-oldest, not the newest.
    """
    pool = PoolKVCache(make_config(16, full_spec(4)), max_model_len=64, hash_seed="s")
    prompt = list(range(1, 10))  # two full blocks and one token
    for rid in ("a", "b", "c"):
        # Budgets below one block: nobody's block is cached before all three allocated.
        assert pool.allocate(rid, prompt, 3, 0, RequestStart()).num_cached_tokens == 0
    for rid in ("a", "b", "c"):
        assert pool.allocate(rid, [], 6).ok
    tables = {rid: pool.block_table(rid).groups[0] for rid in ("a", "b", "c")}
    blocks = pool.manager.block_pool
    first_hash = blocks.block_hash[tables["a"][0]]
    assert first_hash is not None
    assert blocks.cached_blocks_of(first_hash, 0) == [tables[r][0] for r in ("a", "b", "c")]
    pool.free(["a", "b", "c"])
    # Take every uncached free block and two more: a's two cached blocks, freed first (tail
    # first), are the least recently used.
    num_filler = blocks.get_num_free_blocks() - 6 + 2
    filler = list(range(100, 100 + 4 * num_filler))
    assert pool.allocate("filler", filler, len(filler), 0, RequestStart()).ok
    # (The filler's own blocks are cached now, a's among them, under the filler's hashes.)
    assert blocks.cached_blocks_of(first_hash, 0) == [tables["b"][0], tables["c"][0]]
    hit = pool.allocate("d", prompt, 9, 0, RequestStart())
    assert hit.num_cached_tokens == 8
    assert pool.block_table("d").groups[0][:2] == tables["b"][:2]
    check_pool_invariants(
        blocks, [t for r in pool.request_ids() for t in pool.block_table(r).groups]
    )
