"""The planner benchmark runs and reports every shape. Timing is not asserted here, but the
exit status must say what the report says: 1 exactly when a shape misses the 50 ms goal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.tooling import script_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_bench.py"


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    with script_module("plan_bench", BENCH) as module:
        yield module


def test_plan_bench_json(capsys: pytest.CaptureFixture[str], bench: ModuleType) -> None:
    status = bench.main(["--runs", "11", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["goal_ms"] == 50.0
    under_goal = all(r["plan_median_ms"] < report["goal_ms"] for r in report["results"])
    assert report["all_under_goal"] == under_goal
    assert status == (0 if under_goal else 1)
    shapes = [r["shape"] for r in report["results"]]
    assert any("128 layers" in s and "PP=4" in s for s in shapes)
    for result in report["results"]:
        assert 0 < result["plan_median_ms"] <= result["plan_p90_ms"]
        assert result["num_blocks"] > 1
        assert result["ratio_to_goal"] == pytest.approx(result["plan_median_ms"] / 50.0, abs=1e-3)
