"""tail_bench.py measures admissions on a pool that has cycled, with the index as labeled.

Its figures are only what they say when every timed admission reuses cached blocks (the
index loses and gains entries each call) and the "one dict" engine's index really is one
dict; both are checked here on the real core, on a small pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.tooling import script_module

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def tail() -> Iterator[ModuleType]:
    with script_module("tail_bench", BENCHMARKS / "tail_bench.py") as module:
        yield module


def test_every_timed_admission_evicts_cached_blocks(tail: ModuleType) -> None:
    figures = tail.run(3000, 60, 3)
    assert figures["shards"] == {"kvsvc": 4, "kvsvc, one dict": 1}
    for name in ("kvsvc", "kvsvc, one dict"):
        measured = figures[name]
        assert measured["n"] == 60
        # 64 new blocks per admission, each taken from the cached ones.
        assert measured["evictions"] == 60 * 64
        assert 0 < measured["p50_us"] <= measured["p99_us"] <= measured["max_us"]
    assert "kvsvc (4 shards)" in tail.render(figures)
