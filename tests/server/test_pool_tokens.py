"""The tokens a pool's live requests hold (issue 22, item 4), against a real server.

``max_requests`` bounded the count of live requests, not their memory: an admission with
``num_new_tokens=0`` holds its whole prompt with no block, so 1,000 such requests of
131,072 tokens took a server from 56 MB to 1.13 GB. Two bounds now, each past it
RESOURCE_EXHAUSTED naming it, nothing changed: ``max_unscheduled_tokens``, the tokens held
and not scheduled (by default the larger of the KV capacity in tokens and 16 x
max_model_len), which such admissions hit first while engines that schedule what they
admit never do; and ``max_pool_tokens``, every token held (by default the larger of 4 x
the capacity and 256 x max_model_len).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from kvsvc_client import OperationError, ResourceExhaustedError

from kvsvc.server.config import PoolConfig
from kvsvc.server.pool_planning import DEFAULT_UNSCHEDULED_TOKENS_PER_MODEL_LEN
from tests.server.harness import ServerThread, bring_up, running_server, tidy_client

MAX_MODEL_LEN = 256
# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block: 64 blocks, 1,024
# tokens of KV capacity, so the default unscheduled bound is 16 x max_model_len = 4,096.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16
DEFAULT_BOUND = DEFAULT_UNSCHEDULED_TOKENS_PER_MODEL_LEN * MAX_MODEL_LEN
SET_BOUND = 1_000


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pools = (
        PoolConfig(name="p", max_model_len=MAX_MODEL_LEN, max_requests=1_000),
        PoolConfig(
            name="set",
            max_model_len=MAX_MODEL_LEN,
            max_pool_tokens=SET_BOUND,
            max_unscheduled_tokens=100_000,
        ),
    )
    with running_server(*pools) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=65 * BYTES_PER_BLOCK)
        ranks += bring_up(srv, "set", kv_cache_bytes=65 * BYTES_PER_BLOCK)
        yield srv
        for rank in ranks:
            rank.close()


def held(server: ServerThread, pool: str) -> tuple[int, int, int, int]:
    """(tokens held, live requests, free blocks, tokens not scheduled) of ``pool``."""

    def read() -> tuple[int, int, int, int]:
        cache = server.server.pools.get(pool).cache
        usage = cache.usage()
        return (
            cache.num_tokens_held,
            cache.num_requests,
            usage.num_free_blocks,
            cache.num_tokens_unscheduled,
        )

    return server.run(read)  # type: ignore[no-any-return]


def test_zero_block_admissions_stop_at_the_default_bound(server: ServerThread) -> None:
    """Whole prompts admitted with nothing scheduled (no block each) are held up to the
    default unscheduled bound; the next is refused, alone in its Step, and changes
    nothing; an engine's admission that schedules its prompt is still served."""
    with tidy_client(server, "p") as kv:
        fits = DEFAULT_BOUND // MAX_MODEL_LEN
        step = kv.step()
        for i in range(fits + 3):
            step.allocate(f"z{i}", [i % 50_000 + 1] * MAX_MODEL_LEN, 0, start=True)
        results = step.send()
        assert all(not isinstance(r, OperationError) and r.ok for r in results[:fits])
        for refused in results[fits:]:
            assert isinstance(refused, OperationError)
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"max_unscheduled_tokens={DEFAULT_BOUND}" in refused.message
        assert held(server, "p")[:2] == (DEFAULT_BOUND, fits)
        assert kv.allocate("engine", [9] * 10, 10, start=True).ok  # scheduled: served
        before = held(server, "p")
        with pytest.raises(ResourceExhaustedError, match="max_unscheduled_tokens"):
            kv.allocate("one-more", [9] * 10, 0, start=True)
        with pytest.raises(ResourceExhaustedError, match="max_unscheduled_tokens"):
            kv.allocate("engine", [9] * 10, 0)  # appended, not scheduled
        assert held(server, "p") == before
        kv.free("z0")
        assert kv.allocate("one-more", [9] * 10, 0, start=True).ok


def test_continuations_are_bounded_too(server: ServerThread) -> None:
    """A request admitted small may not grow past the bound either: neither by a
    multi-token call nor by single-token calls (the Step's decode fast path)."""
    with tidy_client(server, "set") as kv:
        for i in range(5):
            assert kv.allocate(f"r{i}", [i + 1] * 190, 0, start=True).ok
        assert held(server, "set")[0] == 950
        assert kv.allocate("r0", [5] * 6, 0).ok
        with pytest.raises(ResourceExhaustedError, match=f"max_pool_tokens={SET_BOUND}"):
            kv.allocate("r1", [5] * 50, 0)
        assert held(server, "set")[0] == 956
        step = kv.step()
        for _ in range(60):
            step.allocate("r2", [7], 0)  # one token each: the decode fast path
        results = step.send()
        accepted = [r for r in results if not isinstance(r, OperationError)]
        assert len(accepted) == SET_BOUND - 956
        refused = results[len(accepted) :]
        assert all(
            isinstance(r, OperationError)
            and r.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "max_pool_tokens" in r.message
            for r in refused
        )
        assert held(server, "set")[0] == SET_BOUND
        kv.free(*[f"r{i}" for i in range(5)])
        assert held(server, "set")[0] == 0


def test_an_engine_that_computes_what_it_admits_is_never_refused(server: ServerThread) -> None:
    """Traffic as vLLM sends it (admissions with their chunk scheduled, decodes, frees)
    holds at most what fits in the blocks plus the prompts it shares: far below the
    default bound, whatever the order."""
    with tidy_client(server, "p") as kv:
        live: list[str] = []
        for i in range(400):
            rid = f"e{i}"
            result = kv.allocate(rid, [1] * 200 + [i + 2] * 40, 240, start=True)
            if result.ok:
                live.append(rid)
            if len(live) > 3:
                kv.free(live.pop(0))
        assert held(server, "p")[0] <= 4 * 240
