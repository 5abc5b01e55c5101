"""`kvsvc demo`'s output off a terminal (plain progress lines, no ``\\r``) and
``--keep-serving`` (everything stays up for a scrape until Ctrl-C)."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import redirect_stdout
from types import SimpleNamespace
from typing import Any

import pytest

from kvsvc.commands.demo import Progress

pytestmark = [pytest.mark.e2e]


class _FakeKV:
    def usage(self) -> Any:
        return SimpleNamespace(num_blocks=100, num_free_blocks=60)


def _engine() -> Any:
    stats = SimpleNamespace(
        requests_finished=3, hit_rate=0.5, preemptions=1, latency_percentile=lambda q: 1e-3
    )
    return SimpleNamespace(
        stats=stats, workload=SimpleNamespace(num_requests=10), running=[1], waiting=[]
    )


def _shown(tty: bool, updates: int, *, log_every: float = 3600.0) -> str:
    progress = Progress(_FakeKV(), tty=tty, log_every=log_every)
    out = io.StringIO()
    with redirect_stdout(out):
        for _ in range(updates):
            progress.update(_engine())
        progress.update(_engine(), final=True)
    assert progress.peak_blocks == 40
    return out.getvalue()


def test_progress_redraws_on_a_terminal_and_logs_lines_elsewhere() -> None:
    tty = _shown(True, 5)
    assert tty.count("\r") == 6 and tty.endswith("\n") and tty.count("\n") == 1
    logged = _shown(False, 5)
    # The first update and the final one; the four in between were within log_every.
    assert "\r" not in logged
    lines = logged.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("  finished    3/10  running   1  waiting   0  blocks    40/100")


def test_a_logged_run_has_no_carriage_returns() -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", "demo", "--requests", "40"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stdout
    progress = [line for line in done.stdout.splitlines() if line.startswith("  finished ")]
    assert progress and progress[-1].startswith("  finished   40/40")
    ready = next(line for line in done.stdout.splitlines() if "is READY" in line)
    assert ready.endswith("/metrics while the run lasts (--keep-serving: after)")


def test_keep_serving_holds_metrics_up_until_ctrl_c() -> None:
    pytest.importorskip("torch")
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "demo", "--requests", "20", "--keep-serving"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None
        url = None
        deadline = time.monotonic() + 180
        for line in demo.stdout:
            match = re.search(r"metrics at (http://\S+/metrics)", line)
            url = url or (match.group(1) if match else None)
            if line.startswith("--keep-serving:") or time.monotonic() > deadline:
                break
        assert url and line.startswith("--keep-serving:"), line
        assert "Ctrl-C stops everything" in line
        time.sleep(0.5)  # the run is over: the server must still answer
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "kvsvc_pool_state" in body
        demo.send_signal(signal.SIGINT)
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 0, err
        assert "stopping the agents and the server" in err
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(10)
