"""instruction_counts.py counts the work rpc_bench's server does per call, in steady state.

Its figure is the difference of two valgrind runs, so what the counted calls do must be
what the bench claims: every decode OK, every block a call takes evicting a cached prefix
(a pool that has run a while), each admission hitting the shared prefix. Checked here on
the real core, without valgrind; the output's parsing and the arithmetic too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.frames.helpers import POOL, frames_server, short_dir, unix_target
from tests.tooling import script_module

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def counts() -> Iterator[ModuleType]:
    with script_module("instruction_counts", BENCHMARKS / "instruction_counts.py") as module:
        yield module


def _taken_and_evicted(workload: object) -> tuple[int, int]:
    pool = workload.cache.manager.block_pool  # type: ignore[attr-defined]
    return pool.num_allocated_blocks, pool.num_evictions


def test_every_block_a_counted_step_takes_evicts_a_cached_prefix(counts: ModuleType) -> None:
    workload = counts.Workload("step", 40)
    taken_before, evicted_before = _taken_and_evicted(workload)
    workload.run()
    taken, evicted = _taken_and_evicted(workload)
    # 256 requests growing 40 tokens each cross 640 block boundaries (16 a Step).
    assert taken - taken_before == 640
    assert evicted - evicted_before == taken - taken_before


def test_each_counted_admission_hits_the_shared_prefix_and_evicts_for_the_rest(
    counts: ModuleType,
) -> None:
    workload = counts.Workload("allocate", 5)
    stats = workload.cache.manager.prefix_cache_stats
    hits_before = stats.hits
    taken_before, evicted_before = _taken_and_evicted(workload)
    workload.run()
    taken, evicted = _taken_and_evicted(workload)
    assert stats.hits - hits_before == 5 * counts.SHARED_PREFIX
    per_admission = (counts.PROMPT - counts.SHARED_PREFIX) // counts.BLOCK_SIZE
    assert taken - taken_before == 5 * per_admission
    assert evicted - evicted_before == taken - taken_before


def test_a_mode_it_does_not_know_is_refused(counts: ModuleType) -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        counts.Workload("free", 1)


def test_the_instruction_total_is_read_from_valgrinds_summary(counts: ModuleType) -> None:
    stderr = (
        "==123== Cachegrind, a high-precision tracing profiler\n"
        "==123== \n"
        "==123== I   refs:      2,512,632,974\n"
    )
    assert counts.parse_instructions(stderr) == 2_512_632_974
    with pytest.raises(RuntimeError, match="no instruction total"):
        counts.parse_instructions("==123== error: could not start\n")


def test_a_figure_is_the_difference_per_call(counts: ModuleType) -> None:
    assert counts.per_call(1_300_000_000, 1_000_000_000, 100) == 3_000_000
    with pytest.raises(ValueError, match="calls must be positive"):
        counts.per_call(1, 1, 0)


def test_the_counted_servers_client_makes_ok_decode_steps(counts: ModuleType) -> None:
    """--server's client, against a real server: every request admitted, every decode
    applied (each request grew by the calls' tokens)."""
    with short_dir() as tmp, frames_server(f"unix:{tmp}/s.sock", blocks=512) as srv:
        took = counts.server_steps(unix_target(srv), 5, pool=POOL)
        assert took > 0

        def lengths() -> dict[str, int]:
            cache = srv.server.pools.by_name[POOL].cache
            assert cache is not None
            return {rid: cache.block_table(rid).num_tokens for rid in cache.request_ids()}

        grown = srv.run(lengths)
    assert grown == {f"dec-{r}": 64 + r % 16 + 5 for r in range(counts.SERVER_BATCH)}


def test_the_counted_servers_client_refuses_a_pool_too_small(counts: ModuleType) -> None:
    with (
        short_dir() as tmp,
        frames_server(f"unix:{tmp}/s.sock", blocks=64) as srv,
        pytest.raises(RuntimeError, match="make its pool larger"),
    ):
        counts.server_steps(unix_target(srv), 1, pool=POOL)
