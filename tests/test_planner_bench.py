"""The planner benchmark runs and reports every shape (a smoke test; timing is not asserted
here, the benchmark itself exits 1 when a shape misses the 50 ms goal)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_bench.py"


def test_plan_bench_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("plan_bench", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_bench", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    bench.main(["--runs", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["goal_ms"] == 50.0
    shapes = [r["shape"] for r in report["results"]]
    assert any("128 layers" in s and "PP=4" in s for s in shapes)
    for result in report["results"]:
        assert result["plan_median_ms"] > 0
        assert result["num_blocks"] > 1
        assert result["ratio_to_goal"] == pytest.approx(result["plan_median_ms"] / 50.0, abs=1e-3)
