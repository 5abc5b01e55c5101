"""The core benchmark runs (small sizes) and its figures hold together.

Not "> 0": the hit rate is the workload's exact value, the ratios are the ones the
printed figures give, and the vLLM column says where its figures come from (this run,
a reference measured elsewhere, or nothing). tests/vllm/test_bench_vllm_columns.py runs
the same with vLLM importable, where the column is measured in the same run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvsvc.native
from tests.tooling import script_module

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "core_bench.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with script_module("core_bench", BENCH) as module:
        yield module


@pytest.fixture(scope="module")
def quick_report(bench: ModuleType) -> dict[str, Any]:
    """One ``--quick --json`` run of this process's build (two suite runs, best of each)."""
    return run_main(bench, "--quick", "--json", "--runs", "2", "--build", "this")


def run_main(bench: ModuleType, *args: str) -> dict[str, Any]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(list(args)) == 0
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


def check_relations(bench: ModuleType, report: dict[str, Any]) -> None:
    """What must hold between the figures of one report, whoever ran it."""
    # 16 requests sharing half of each prompt: the first misses, the rest hit the half.
    assert report["hit_rate"] == report["expected_hit_rate"] == pytest.approx(15 / 32, abs=0)
    for tag in ("xxh3", "sha256", "hybrid"):
        assert report[f"facade_{tag}_hit_rate"] == report["hit_rate"], tag
    # Kept as the best of the runs: the fastest cycle time and the highest rate go together.
    assert report["alloc_free_cycles_per_s"] == pytest.approx(1e6 / report["alloc_free_cycle_us"])
    for key in (
        "pool_build_1m_s",
        "pool_bytes_per_block",
        "alloc_free_cycle_us",
        "hash_xxh3_tokens_per_s",
        "hash_sha256_tokens_per_s",
        "decode_allocate_us_p50",
        "prompt_allocate_us_p50",
        "timer_overhead_us",
    ):
        assert report[key] > 0, key
    # The per-call figures include the timer pair, so none is below it.
    assert report["decode_allocate_us_p50"] >= report["timer_overhead_us"]
    figures = report["vllm"]
    if report["vllm_source"] == "measured":
        assert report["vllm_version"]
        assert set(bench.REFERENCE) <= set(figures)  # every reference figure is measured
        # The same workload on vLLM's manager hits exactly the same tokens.
        assert figures["hit_rate"] == report["hit_rate"]
    elif report["vllm_source"] == "reference":
        assert figures == bench.REFERENCE
    else:
        assert report["vllm_source"] == "none" and figures == {}
    expected = {}
    for key, reference in figures.items():
        if key == "hit_rate" or key not in report:
            continue
        higher = key in bench.HIGHER_IS_BETTER
        expected[key] = report[key] / reference if higher else reference / report[key]
    assert report["vs_vllm"] == pytest.approx(expected)


def test_quick_run_figures_hold_together(bench: ModuleType, quick_report: dict[str, Any]) -> None:
    check_relations(bench, quick_report)
    # Without vLLM a quick run shows no vLLM figures: the reference is for the full sizes.
    if bench.load_vllm() is None:
        assert quick_report["vllm_source"] == "none"


def _rows(table: str) -> dict[str, list[str]]:
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _bounds(cell: str) -> tuple[float, float]:
    """The interval a printed figure was rounded from (half a unit of its last digit)."""
    scale = 1e6 if cell.endswith("M") else 1.0
    text = cell.rstrip("Mx").replace(",", "")
    decimals = len(text.partition(".")[2])
    half = 0.5 * 10.0**-decimals
    value = float(text)
    return (value - half) * scale, (value + half) * scale


def test_the_reference_column_says_so_and_its_ratios_are_the_printed_figures(
    bench: ModuleType, quick_report: dict[str, Any]
) -> None:
    """Rendered at the full sizes without vLLM figures, the column is the reference,
    labelled as not measured here, and each "vs vLLM" is the ratio of the printed
    figures (up to their rounding)."""
    results = {k: v for k, v in quick_report.items() if isinstance(v, float)}
    results = {k: v for k, v in results.items() if not k.startswith("vllm_")}
    table = bench.render_table(results, bench.Sizes())
    header = [c.strip() for c in table.splitlines()[0].split("|")]
    assert header[5] == "vLLM (reference, not measured here)"
    compared = 0
    for label, cells in _rows(table).items():
        measured, _, _, _, reference, ratio = cells
        if not ratio or ratio == "exact" or not reference:
            continue
        key = next(k for k, lab, _ in bench.ROWS if lab == label)
        (v_lo, v_hi), (r_lo, r_hi), (s_lo, s_hi) = (
            _bounds(measured),
            _bounds(reference),
            _bounds(ratio),
        )
        # The ratio of two rounded figures lies between these; the printed one must too.
        if key in bench.HIGHER_IS_BETTER:
            low, high = v_lo / r_hi, v_hi / r_lo
        else:
            low, high = r_lo / v_hi, r_hi / max(v_lo, 1e-12)
        assert s_hi >= low and s_lo <= high, (label, measured, reference, ratio)
        compared += 1
    assert compared >= 8
    # The JSON's ratios against the reference are the same divisions.
    report = {**quick_report, "vllm_source": "reference", "vllm": dict(bench.REFERENCE)}
    report["vs_vllm"] = bench.vs_vllm(results, bench.Sizes())
    check_relations(bench, report)


def test_the_table_names_the_sizes_it_ran(bench: ModuleType, quick_report: dict[str, Any]) -> None:
    results = {k: v for k, v in quick_report.items() if isinstance(v, float)}
    table = bench.render_table(results, bench.QUICK)
    assert "hash 256-token prompt" in table and "2048-token" not in table
    assert re.search(r"pool build, 0\.05M blocks", table)
    hit_row = _rows(table)["workload: prefix hit rate"]
    assert hit_row[0] == hit_row[1] == f"{15 / 32:.3f}" and hit_row[2] == "exact"


def test_both_builds_run_side_by_side(bench: ModuleType) -> None:
    """By default the compiled and the pure build each run in a process of their own (where
    the compiled one is built); each report holds together and names its build."""
    report = run_main(bench, "--quick", "--json", "--runs", "1", "--no-vllm")
    if kvsvc.native.BUILD != "mypyc":  # nothing compiled to compare: this build alone
        assert report["build"] == kvsvc.native.BUILD
        check_relations(bench, report)
        return
    assert set(report["builds"]) == {"mypyc", "pure"}
    for figures in report["builds"].values():
        check_relations(bench, figures)
    # The same workload on both: the same exact hit rate.
    assert report["builds"]["mypyc"]["hit_rate"] == report["builds"]["pure"]["hit_rate"]
    table = bench.render_builds_table(report["builds"], bench.QUICK)
    header = [c.strip() for c in table.splitlines()[0].split("|")]
    assert header[1:4] == ["mypyc", "pure", "mypyc vs pure"]
