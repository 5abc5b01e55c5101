"""`kvsvc replay` end to end on a small trace where every prompt shares its first block:
real `kvsvc serve` pools, `kvsvc indexer` and `kvsvc router` on a private redis-server.
Routing by the prefix alone collapses onto one engine there; Route, which weighs the
engines' live load, spreads the prompts. Fails if Route ignores the load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.replay.traces import shared_first_block, write_trace
from tests.tooling import require_tool

pytestmark = pytest.mark.e2e
ENGINES = 3


def test_prefix_only_collapses_and_route_spreads_the_load(tmp_path: Path) -> None:
    require_tool("redis-server", "kvsvc replay starts one: apt-get install redis-server")
    pytest.importorskip("matplotlib")
    # The first prompt 10 trace seconds (1 s at the time scale) before the others: the
    # index holds its shared block by then, whatever the indexer's lag on a busy machine.
    rows = shared_first_block(36, 16, lead_ms=10_000)
    trace = write_trace(tmp_path / "conversations.jsonl", rows)
    chart = tmp_path / "chart.png"
    result = subprocess.run(
        [
            sys.executable, "-m", "kvsvc", "replay", str(trace), "--trace-block-size", "16",
            "--engines", str(ENGINES), "--kv-tokens", "4096",
            "--policies", "prefix-only,route", "--time-scale", "10",
            "--prefill-tps", "2000", "--decode-ms", "20", "--load-interval", "0.05",
            "--json", "--plot", str(chart), "--quiet",
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["trace"]["requests"] == 36 and report["trace"]["block_size"] == 16
    (run,) = report["runs"]
    assert (run["engines"], run["kv_tokens"]) == (ENGINES, 4096)
    # 35 of 36 prompts can hit the shared block: 35 x 16 of 36 x 64 tokens.
    infinite = run["bounds"]["infinite_cache"]
    assert (infinite["cached_tokens"], infinite["prompt_tokens"]) == (35 * 16, 36 * 64)
    prefix_only, route = run["policies"]["prefix-only"], run["policies"]["route"]
    # Prefix only: the engine that cached the shared block first wins every prompt after.
    assert prefix_only["load_max_mean"] == pytest.approx(ENGINES)
    assert prefix_only["requests"] == route["requests"] == 36
    # Route: every engine gets its share, and caches the shared block in turn.
    assert route["load_max_mean"] < 1.6
    assert route["hit_ratio"] >= 0.8 * prefix_only["hit_ratio"]
    assert route["decided_by"].get("load", 0) > 0
    assert all(engine["computed_tokens"] > 0 for engine in route["engines"])
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_pool_too_small_for_its_batch_preempts_and_every_request_finishes(
    tmp_path: Path,
) -> None:
    """Prompts of 4 blocks that grow 4 more while decoding, two engines of 12 blocks:
    two requests fit at admission, not at their end. The engine preempts its newest
    running request (freed on the pool, admitted again with its outputs), and every
    request still finishes."""
    require_tool("redis-server", "kvsvc replay starts one: apt-get install redis-server")
    rows = shared_first_block(12, 16, every_ms=20, output=64)
    trace = write_trace(tmp_path / "long-outputs.jsonl", rows)
    result = subprocess.run(
        [
            sys.executable, "-m", "kvsvc", "replay", str(trace), "--trace-block-size", "16",
            "--engines", "2", "--kv-tokens", "192", "--policies", "round-robin",
            "--time-scale", "20", "--decode-ms", "5", "--step-iterations", "4",
            "--json", "--quiet",
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    rr = run["policies"]["round-robin"]
    assert rr["preemptions"] > 0
    assert rr["requests"] == rr["completed"] == 12
