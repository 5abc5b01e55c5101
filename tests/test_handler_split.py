"""handler_split.py's Step stages measure every decode's whole work.

A decode answered NO_SPACE skips the append, the hashing and the caching, so a pool that
runs out partway makes the in-process "core" figure read a fraction of what the server
does per Step (it once read about half). The Step bench sizes its pool by the Steps it
runs and fails on a NO_SPACE: both are checked here, on the real core.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.tooling import script_module

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def split() -> Iterator[ModuleType]:
    with script_module("handler_split", BENCHMARKS / "handler_split.py") as module:
        yield module


def test_the_step_pool_holds_every_decode_of_the_steps_measured(split: ModuleType) -> None:
    # Past the old fixed pool's 4,096 blocks: 256 requests of up to 79 + 180 tokens.
    steps = 180
    stages, whole, _ = split.step_stages(steps)
    assert len(whole) == steps
    assert set(stages) >= {"decode", "core", "reply"}
    assert all(len(samples) == steps for samples in stages.values())


def test_a_pool_too_small_for_the_steps_fails_the_bench(
    split: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(split, "_step_pool_blocks", lambda n: 4096)
    with pytest.raises(RuntimeError, match="NO_SPACE: the pool is too small"):
        split.step_stages(180)


def test_the_stages_run_under_the_servers_collector_settings(split: ModuleType) -> None:
    import gc

    from kvsvc.commands.serve import GC_THRESHOLDS

    before = gc.get_threshold()
    with split.server_gc():
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0  # what was alive (the pool) is out of collections
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_the_cold_runs_write_their_bytes_before_each_call(split: ModuleType) -> None:
    evict = split._Evictor(1 << 20)
    assert not any(evict._target)
    evict()
    assert evict._target == evict._source and len(evict._target) == 1 << 20
    # The cold run measures the same stages, one sample per Step.
    stages, whole, _ = split.step_stages(20, split.EVICT_BYTES)
    assert len(stages["core"]) == len(whole) == 20
