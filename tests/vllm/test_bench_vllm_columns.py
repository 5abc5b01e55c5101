"""Where vLLM is importable, the benchmarks' vLLM columns are measured in the same run.

core_bench.py runs vLLM's own BlockPool, request hasher and KVCacheManager on its
workloads; rpc_bench.py runs vLLM's manager on its Step's decode workload. Their reports
must say "measured" with vLLM's version, the same workload must hit exactly as many
tokens on vLLM as on kvsvc, and every ratio must be the one the two figures give.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm

from tests.core.test_core_bench import check_relations as check_core_relations
from tests.e2e.test_rpc_bench import check_relations as check_rpc_relations
from tests.e2e.test_rpc_bench import run_bench as run_rpc_bench

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_core_bench_measures_vllm_in_the_same_run(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("core_bench", BENCHMARKS / "core_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "core_bench", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--quick", "--json", "--runs", "1"]) == 0
    printed: dict[str, Any] = json.loads(out.getvalue())
    # Both builds of the core where the compiled one is there, each against the same vLLM.
    reports = list(printed["builds"].values()) if "builds" in printed else [printed]
    for report in reports:
        assert report["vllm_source"] == "measured"
        assert report["vllm_version"] == vllm.__version__
        check_core_relations(bench, report)
        # The column is this run's: it has figures the reference never had.
        assert {"free_us_p50", "hash_prompt_us_p50"} <= set(report["vllm"]) - set(bench.REFERENCE)
    report = reports[0]
    table = bench.render_table(
        {k: v for k, v in report.items() if isinstance(v, float)}, bench.QUICK, vllm.__version__
    )
    assert f"vLLM {vllm.__version__} (this run)" in table.splitlines()[0]


@pytest.mark.torch
def test_rpc_bench_measures_vllm_in_the_same_run() -> None:
    pytest.importorskip("torch")
    figures = run_rpc_bench()
    assert figures["vllm_source"] == "measured"
    assert figures["vllm_version"] == vllm.__version__
    check_rpc_relations(figures)
