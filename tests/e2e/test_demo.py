"""`kvsvc demo` runs to completion with a `hit rate` line, and stops cleanly on Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]


def test_demo_runs_to_completion() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", "demo", "--requests", "40"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "is READY" in done.stdout
    assert any("hit rate" in line for line in done.stdout.splitlines()[-15:])
    assert "requests finished           40" in done.stdout


def _final_table(*flags: str) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", "demo", "--requests", "60", *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    table = {}
    for line in done.stdout.splitlines():
        label, _, value = line.partition("  ")
        if value.strip():
            table[label.strip()] = value.strip()
    return table


def test_the_demo_over_the_framed_transport_does_the_same_work() -> None:
    """``--frames``: the simulated engine's calls go over the server's framed socket; the
    seeded workload gives the same hits, preemptions and evictions as over gRPC (latency
    aside)."""
    over_grpc = _final_table()
    over_frames = _final_table("--frames")
    same = (
        "requests finished",
        "prompt tokens",
        "tokens served from cache",
        "hit rate",
        "tokens generated",
        "steps",
        "preemptions",
        "evictions",
    )
    assert {k: over_frames[k] for k in same} == {k: over_grpc[k] for k in same}
    assert over_frames["requests finished"] == "60"


def test_demo_stops_cleanly_on_ctrl_c() -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "demo", "--requests", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None
    deadline = time.monotonic() + 120
    for line in demo.stdout:  # wait until the engine is running
        if line.startswith("running ") or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    demo.send_signal(signal.SIGINT)
    _, err = demo.communicate(timeout=60)
    assert demo.returncode == 130, err
    assert "stopping the agents and the server" in err
