"""The state benchmark runs end to end (short form) and its figures hold together.

Not "> 0": every p99 is at least its p50, the overheads are the ones the printed medians
give, a restart serves the pool it stopped with (the live requests and cached blocks it
had; after kill -9 the replayed decodes added blocks, none lost, and every journaled row of
each kind of load was replayed), and the serving time includes the load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "state_bench.py"


def test_state_bench_quick_json() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    steps = figures["step256"]
    for name in ("memory", "normal", "full"):
        assert 0 < steps[name]["p50_us"] <= steps[name]["p99_us"], name
    for name in ("normal", "full"):
        overhead = steps[name]["p50_us"] / steps["memory"]["p50_us"] - 1
        assert steps[name]["p50_overhead"] == pytest.approx(overhead, abs=0.002)
    assert steps["journal"]["rows"] > 0 and steps["journal"]["payload_bytes_per_step"] > 0

    restart = figures["restart"]
    built = restart["built"]
    assert built["live_requests"] == 500 and built["cached_blocks"] > 0
    graceful, killed = restart["after_graceful_stop"], restart["after_kill_with_journal"]
    assert graceful["live_requests"] == built["live_requests"]
    assert graceful["cached_blocks"] == built["cached_blocks"]
    assert set(killed) == {"decode_steps", "single_calls"}
    for load, run in killed.items():
        assert run["live_requests"] == built["live_requests"], load
        assert run["cached_blocks"] >= built["cached_blocks"], load
        # The restart replayed exactly the journal the load wrote (no snapshot meanwhile).
        assert run["journal_operations"] > 0 and run["rows_replayed"] == run["journal_rows"]
    for run in (graceful, *killed.values()):
        assert 0 <= run["load_replay_s"] <= run["first_call_s"]
        assert run["listening_s"] <= run["first_call_s"]

    sizes = figures["size"]
    assert sizes["bytes_per_cached_block"] > 0 and sizes["bytes_per_live_request"] > 0
