"""A seeded model engine for restart tests: it drives a pool and remembers exactly what
the server acknowledged (tests/server/test_restart.py, tests/e2e/test_crash_restart.py)."""

from __future__ import annotations

import random
from typing import Any

from kvsvc_client import AllocateStatus, KVCacheClient, RequestStart


class Engine:
    """A seeded engine on one pool: admissions with shared prefixes, decode Steps,
    preemptions and resumptions, frees. It keeps what the server acknowledged: each live
    request's tokens, block table and computed count."""

    def __init__(self, kv: KVCacheClient, seed: int) -> None:
        self.kv = kv
        self.rng = random.Random(seed)
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0
        self.prefixes = [[p] * 32 for p in (1, 2)]
        self.recomputed = 0  # requests it preempted and re-admitted on RECOMPUTE
        # Every request it freed, by any path (finished, preempted, NO_SPACE victim,
        # RECOMPUTE): a request flagged for recompute that it happens to free first
        # never sees the status, and needs none.
        self.released: set[str] = set()

    def admit(self, rid: str, prompt: list[int], resumed: bool = False) -> Any:
        result = self.kv.allocate(rid, prompt, len(prompt), start=RequestStart(resumed=resumed))
        if result.ok:
            self.tokens[rid] = list(prompt)
            self.tables[rid] = list(result.new_block_ids[0])
            self.computed[rid] = result.num_computed_tokens
        return result

    def step(self) -> None:
        rng = self.rng
        if len(self.tokens) < 6 or rng.random() < 0.3:
            self.next_id += 1
            prompt = rng.choice(self.prefixes) + [rng.randrange(1, 900) for _ in range(20)]
            self.admit(f"r{self.next_id}", prompt)
            return
        if rng.random() < 0.15:
            rid = rng.choice(sorted(self.tokens))
            preempted = rng.random() < 0.5
            self.kv.free(rid, preempted=preempted)
            self.released.add(rid)
            tokens = self.tokens.pop(rid)
            del self.tables[rid], self.computed[rid]
            if preempted:
                self.admit(rid, tokens, resumed=True)
            return
        batch = sorted(self.tokens)
        step = self.kv.step()
        sampled = {rid: rng.randrange(1, 900) for rid in batch}
        for rid in batch:
            step.allocate(rid, [sampled[rid]], 1)
        full = False
        lost = []
        for rid, result in zip(batch, step.send(), strict=True):
            if result.ok:
                self.tokens[rid].append(sampled[rid])
                self.tables[rid].extend(result.new_block_ids[0])
                self.computed[rid] = result.num_computed_tokens
            elif result.needs_recompute:
                lost.append(rid)
            else:
                assert result.status is AllocateStatus.NO_SPACE, result
                full = True
        for rid in lost:  # its KV data is gone: preempt it and admit it again
            self.kv.free(rid, preempted=True)
            self.released.add(rid)
            tokens = self.tokens.pop(rid)
            del self.tables[rid], self.computed[rid]
            self.recomputed += 1
            self.admit(rid, tokens, resumed=True)
        if full and self.tokens:  # preempt the longest, as a scheduler would
            victim = max(self.tokens, key=lambda r: len(self.tokens[r]))
            self.kv.free(victim, preempted=True)
            self.released.add(victim)
            del self.tokens[victim], self.tables[victim], self.computed[victim]

    def check(self, kv: KVCacheClient) -> None:
        """Every acknowledged live request is where the acknowledgement left it."""
        for rid, table in self.tables.items():
            view = kv.block_table(rid)
            assert list(view.groups[0]) == table, rid
            assert view.num_computed_tokens == self.computed[rid], rid
            assert view.num_tokens == len(self.tokens[rid]), rid
        usage = kv.usage()
        assert usage.num_requests == len(self.tables)
        held = {b for table in self.tables.values() for b in table}
        assert usage.num_free_blocks == usage.num_blocks - len(held)
