"""``python -m kvsvc.tools.healthcheck --server auto``: the server image's HEALTHCHECK finds
the container's ``kvsvc serve`` process and checks it on the address its command listens on.

A fixed ``--server 127.0.0.1:50051`` called a server started with ``--listen 0.0.0.0:6000``
unhealthy. The process table is a directory laid out like ``/proc`` (``PID/cmdline``,
``PID/cwd``): the suite's machine runs other ``kvsvc serve`` processes, a container runs one.
The live test copies a real server's command line from the real ``/proc``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from kvsvc.tools.healthcheck import (
    ServeProcessError,
    agent_metrics_address,
    check_grpc,
    find_serve_process,
    resolve_auto_agent_metrics,
    resolve_auto_server,
    serve_address,
)
from tests.tooling import free_port

# How an image's `kvsvc serve` shows in /proc: the console script under its interpreter.
SCRIPT = ["/opt/kvsvc/venv/bin/python", "/opt/kvsvc/venv/bin/kvsvc"]


def fake_proc(root: Path, processes: dict[int, list[str]], cwd: Path | None = None) -> Path:
    """A /proc-like tree: ``PID/cmdline`` (NUL-terminated arguments) and ``PID/cwd``."""
    for pid, argv in processes.items():
        directory = root / str(pid)
        directory.mkdir(parents=True)
        (directory / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
        (directory / "cwd").symlink_to(cwd or root)
    return root


def test_pid_1_is_the_container_server(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {1: [*SCRIPT, "serve", "--listen", "0.0.0.0:6000"], 7: [*SCRIPT, "serve"]},
    )
    assert find_serve_process(proc) == ("1", ["--listen", "0.0.0.0:6000"])
    # The wildcard host is asked on loopback, on the port the command names.
    assert resolve_auto_server(proc) == "127.0.0.1:6000"


def test_behind_an_init_process_the_only_server_is_found(tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path,
        {
            1: ["/run/podman-init", "--", "kvsvc", "serve", "--listen", "[::]:7000"],
            12: ["python", "-m", "kvsvc", "serve", "--listen=[::]:7001"],
            13: [*SCRIPT, "worker", "--server", "127.0.0.1:7001"],
        },
    )
    # An init whose arguments are `kvsvc serve ...` names the same command as its child.
    assert find_serve_process(proc) == ("1", ["--listen", "[::]:7000"])
    (proc / "1" / "cmdline").write_bytes(b"/run/podman-init\0--\0/bin/sh\0")
    assert find_serve_process(proc) == ("12", ["--listen=[::]:7001"])
    assert resolve_auto_server(proc) == "::1:7001"


def test_no_server_or_several_is_unhealthy_with_the_reason(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "none", {1: ["/bin/sh"], 5: [*SCRIPT, "worker"]})
    with pytest.raises(ServeProcessError, match="no kvsvc serve process"):
        find_serve_process(proc)
    proc = fake_proc(
        tmp_path / "two", {1: ["/bin/sh"], 5: [*SCRIPT, "serve"], 6: ["kvsvc", "serve"]}
    )
    with pytest.raises(ServeProcessError, match=r"several kvsvc serve processes \(5, 6\)"):
        find_serve_process(proc)


def test_the_address_is_read_as_the_server_reads_it(tmp_path: Path) -> None:
    assert serve_address([], tmp_path) == "127.0.0.1:50051"  # the default
    assert serve_address(["--listen", "10.1.2.3:6000"], tmp_path) == "10.1.2.3:6000"
    # TCP before a socket whichever comes first; a socket alone is asked over the socket.
    both = ["--listen", "unix:/run/kvsvc/kvsvc.sock", "--listen", "0.0.0.0:6001"]
    assert serve_address(both, tmp_path) == "127.0.0.1:6001"
    assert serve_address(["--listen", "unix:/run/k.sock,0.0.0.0:6002"], tmp_path).endswith(":6002")
    assert serve_address(["--listen", "unix:k.sock"], tmp_path) == f"unix:{tmp_path}/k.sock"
    # A config file (relative to the server's working directory); flags win over it.
    (tmp_path / "kvsvc.toml").write_text('listen = "0.0.0.0:6003"\n')
    assert serve_address(["--config", "kvsvc.toml", "--pool", "p"], tmp_path) == ("127.0.0.1:6003")
    assert serve_address(["--config", "kvsvc.toml", "--listen", "0.0.0.0:6004"], tmp_path) == (
        "127.0.0.1:6004"
    )


def test_an_address_the_command_does_not_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ServeProcessError, match="a free port chosen at start"):
        serve_address(["--listen", "127.0.0.1:0"], tmp_path)
    with pytest.raises(ServeProcessError, match="cannot read config file"):
        serve_address(["--config", "missing.toml"], tmp_path)


def test_agent_metrics_auto_asks_the_workers_metrics_port(tmp_path: Path) -> None:
    """The worker image's check: the /metrics port the container's kvsvc worker names
    (a fixed 9401 called a worker started with --metrics-listen 0.0.0.0:9500 unhealthy)."""
    flags = ["--server", "s:1", "--pool", "p", "--rank", "0", "--world-size", "1"]
    flags += ["--device", "cpu"]
    worker = [*SCRIPT, "worker", *flags]
    proc = fake_proc(
        tmp_path / "one",
        {1: [*worker, "--metrics-listen", "0.0.0.0:9500"], 8: [*SCRIPT, "serve"]},
    )
    assert resolve_auto_agent_metrics(proc) == "127.0.0.1:9500"
    assert agent_metrics_address([*flags, "--metrics-listen=[::]:9501"]) == "[::1]:9501"
    assert agent_metrics_address([*flags, "--metrics-listen", "10.0.0.7:9502"]) == ("10.0.0.7:9502")
    with pytest.raises(ServeProcessError, match="serves no /metrics"):
        agent_metrics_address(flags)
    with pytest.raises(ServeProcessError, match="no fixed port"):
        agent_metrics_address([*flags, "--metrics-listen", "127.0.0.1:0"])
    none = fake_proc(tmp_path / "none", {1: ["/bin/sh"], 5: [*SCRIPT, "serve"]})
    with pytest.raises(ServeProcessError, match="--agent-metrics auto: no kvsvc worker process"):
        resolve_auto_agent_metrics(none)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    stop_all(started)


@pytest.mark.e2e
def test_a_live_server_on_another_port_is_healthy(tmp_path: Path, children: list[Child]) -> None:
    """A real ``kvsvc serve`` on a port other than 50051, its command line as /proc shows
    it, found and asked SERVING; the fixed port of before finds nothing there."""
    port = free_port()
    argv = ["serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off", "--pool", "p"]
    server = spawn("server", argv)
    children.append(server)
    wait_for_ports(server)
    real = Path("/proc") / str(server.process.pid)
    if not (real / "cmdline").is_file():
        pytest.skip("no /proc here to read a process's command line from")
    shown = [a.decode() for a in (real / "cmdline").read_bytes().split(b"\0")[:-1]]
    assert shown == [sys.executable, "-m", "kvsvc", *argv]
    proc = fake_proc(tmp_path, {1: shown}, cwd=Path(os.getcwd()))
    address = resolve_auto_server(proc)
    assert address == f"127.0.0.1:{port}"
    result = check_grpc(address)
    assert result.healthy, result.message
