"""One server per state directory (issue 22, item 6), with real `kvsvc serve` processes.

A second server on a directory another one serves is refused at start (exit 1, one line
naming the holder's pid and port) and touches nothing there; the directory is usable again
as soon as the holder is gone, even after a SIGKILL (the kernel drops the lock with the
process, no stale lock file to remove).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports

pytestmark = pytest.mark.e2e


def serve_args(state_dir: Path) -> list[str]:
    return [
        "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p",
        "--state-dir", str(state_dir), "--log-level", "WARNING",
    ]  # fmt: skip


@pytest.fixture()
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    try:
        yield started
    finally:
        stop_all(started)


def start(children: list[Child], state_dir: Path) -> tuple[Child, int]:
    child = spawn(f"server-{len(children)}", serve_args(state_dir))
    children.append(child)
    port, _ = wait_for_ports(child, timeout=60)
    return child, port


def serve_once(state_dir: Path) -> subprocess.CompletedProcess[str]:
    """A second `kvsvc serve` on ``state_dir``, expected to stop at start."""
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", *serve_args(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_second_server_on_a_state_dir_is_refused_naming_the_holder(
    tmp_path: Path, children: list[Child]
) -> None:
    state_dir = tmp_path / "state"
    holder, port = start(children, state_dir)
    before = {p.name: p.stat().st_mtime_ns for p in state_dir.iterdir()}

    second = serve_once(state_dir)

    assert second.returncode == 1, second.stdout + second.stderr
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith(f"kvsvc serve: state_dir {state_dir} is in use by another kvsvc")
    assert f"pid {holder.process.pid}" in line and f"port {port}" in line
    assert "serving" not in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in state_dir.iterdir()} == before
    assert holder.alive()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path, children: list[Child]) -> None:
    state_dir = tmp_path / "state"
    holder, _ = start(children, state_dir)
    holder.process.kill()  # SIGKILL: nothing of the server's own code runs
    holder.process.wait(10)

    _, port = start(children, state_dir)  # at once: no wait, no file to remove

    assert port > 0
    assert serve_once(state_dir).returncode == 1  # and the new server holds it now
