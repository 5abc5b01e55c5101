"""Where vLLM is importable, the benchmarks' vLLM columns are measured in the same run.

core_bench.py runs vLLM's own BlockPool, request hasher and KVCacheManager on its
workloads; rpc_bench.py runs vLLM's manager on its Step's decode workload. Their reports
must say "measured" with vLLM's version, the same workload must hit exactly as many
tokens on vLLM as on kvsvc, and every ratio must be the one the two figures give.
vllm_bench.py's engines (stock vLLM and vLLM on kvsvc) must each have their figures.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import vllm

from tests.core.test_core_bench import check_relations as check_core_relations
from tests.e2e.test_rpc_bench import check_relations as check_rpc_relations
from tests.e2e.test_rpc_bench import run_bench as run_rpc_bench
from tests.tooling import script_module

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def core_bench() -> Iterator[ModuleType]:
    with script_module("core_bench", BENCHMARKS / "core_bench.py") as module:
        yield module


@pytest.fixture
def vllm_bench() -> Iterator[ModuleType]:
    with script_module("vllm_bench", BENCHMARKS / "vllm_bench.py") as module:
        yield module


def test_core_bench_measures_vllm_in_the_same_run(core_bench: ModuleType) -> None:
    bench = core_bench
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


def test_vllm_bench_measures_each_engines_scheduler_and_cpu(
    vllm_bench: ModuleType,
) -> None:
    """One small round of vllm_bench.py: every engine has every figure it should, the
    kvsvc engines' Step sender thread is found and did work, and the table fits 100
    columns."""
    import argparse

    from tests.vllm.helpers import vllm_test_env

    bench = vllm_bench
    args = argparse.Namespace(
        rounds=2, requests=4, max_tokens=8, blocks=256, no_pure=True, steps_per_call=4
    )
    with vllm_test_env():
        lines = bench.bench_model(vllm, "llama", args)
    assert lines[0] == "scheduler classes: stock Scheduler, on kvsvc KvsvcScheduler"

    def engines_of(figure: str) -> dict[str, list[str]]:
        start = lines.index(figure) + 1
        rows = {}
        for line in lines[start:]:
            if not line.startswith("  ") or line.startswith("  of it") or "the rest" in line:
                break
            # A label may hold spaces ("frames, inline Steps"); columns are 2+ spaces apart.
            name, *values = re.split(r"\s{2,}", line.strip())
            rows[name] = " ".join(values).split()
        return rows

    kvsvc_only = [
        "gRPC",
        "frames",
        "frames, inline Steps",
        "gRPC, steps held",
        "frames, steps held",
    ]
    both = ["stock", *kvsvc_only]
    assert list(engines_of("scheduler thread CPU per step, us")) == both
    assert list(engines_of("  of it in the KV cache manager, us")) == both
    assert list(engines_of("  of it sending, awaiting Steps, us")) == kvsvc_only
    assert list(engines_of("engine process CPU per output token, us")) == both
    # The process's CPU split: its main thread's (the engine loop) and torch's threads'.
    main_rows = engines_of("  of it the main thread (forward pass too), us")
    assert list(main_rows) == both
    assert all(float(v[0].replace(",", "")) > 0 for v in main_rows.values())
    assert list(engines_of("  of it threads not Python's (torch's), us")) == both
    senders = engines_of("kvsvc Step sender thread CPU/step, us")
    assert list(senders) == kvsvc_only

    def least(values: list[str]) -> float:
        return float(values[1].strip("[").split("-")[0].replace(",", ""))

    # The sender thread did work in every round (it sends each step's Step); inline Steps
    # have no sender thread: the scheduler's thread sends and reads them.
    assert least(senders["gRPC"]) > 0 and least(senders["frames"]) > 0
    assert senders["frames, inline Steps"][0] == "0"
    sending = engines_of("  of it sending, awaiting Steps, us")
    assert float(sending["frames, inline Steps"][0]) > 0
    assert list(engines_of("kvsvc server CPU per output token, us")) == kvsvc_only
    calls = lines[lines.index(next(x for x in lines if x.startswith("kvsvc calls"))) + 1 :]
    # 2 rounds of 4 requests x 8 tokens: 8 scheduling steps a round on each kvsvc engine.
    assert [line.split()[-1] for line in calls] == ["16"] * 5
    # RPCs a step (median / most): one a step, but for the engines holding steps (which
    # send every fourth decode-only step, and at once the step that admits).
    medians = {
        re.split(r"\s{2,}", line.strip())[0]: line.split("/")[0].split()[-1] for line in calls
    }
    assert medians == {
        "gRPC": "1",
        "frames": "1",
        "frames, inline Steps": "1",
        "gRPC, steps held": "0",
        "frames, steps held": "0",
    }
    assert max(len(line) for line in lines) <= 100
