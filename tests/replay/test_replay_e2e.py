"""`kvsvc replay` end to end on a small trace where every prompt shares its first block:
real `kvsvc serve` pools, `kvsvc indexer` and `kvsvc router` on a private redis-server.
Routing by the prefix alone collapses onto one engine there; Route, which weighs the
engines' live load, spreads the prompts. Fails if Route ignores the load."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
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


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def test_sigterm_stops_the_fleet_it_started(tmp_path: Path) -> None:
    """A replay stopped with SIGTERM (or Ctrl-C) stops its servers, indexer, router and
    redis-server before it exits 130: nothing is left running."""
    require_tool("redis-server", "kvsvc replay starts one: apt-get install redis-server")
    trace = write_trace(tmp_path / "slow.jsonl", shared_first_block(20, 16, every_ms=2000))
    replay = subprocess.Popen(
        [
            sys.executable, "-m", "kvsvc", "replay", str(trace), "--trace-block-size", "16",
            "--engines", "2", "--kv-tokens", "4096", "--policies", "route", "--time-scale", "1",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert replay.stderr is not None
        for line in replay.stderr:  # the fleet is up once the first request is routed
            if "starting the fleet" in line:
                break
        deadline = time.monotonic() + 60
        while len(_children(replay.pid)) < 5:  # redis, 2 servers, indexer, router
            assert replay.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        started = _children(replay.pid)
        replay.send_signal(signal.SIGTERM)
        assert replay.wait(60) == 130
        assert "interrupted" in replay.stderr.read()
        alive = [pid for pid in started if Path(f"/proc/{pid}").exists()]
        assert not alive, f"left running: {alive}"
    finally:
        if replay.poll() is None:
            replay.kill()
            replay.wait(10)
