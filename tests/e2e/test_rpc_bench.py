"""The RPC benchmark runs end to end (short form) and prints the figures it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rpc_bench.py"


def test_rpc_bench_quick_json() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    for key in (
        "echo_p50_us",
        "step256_p50_us",
        "step256_p99_us",
        "allocate_new_p50_us",
        "concurrent_ops_per_s",
    ):
        assert figures[key] > 0, key
    assert figures["step256_p99_us"] >= figures["step256_p50_us"]
