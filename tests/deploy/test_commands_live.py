"""The deployment's commands, run for real: what the Dockerfile, compose and the Kubernetes
pod start, and the health checks and probes they use, as processes on loopback.

Each scenario takes its commands from the artefact itself, changes only the addresses
(container hostnames and fixed ports become 127.0.0.1 and free ports) and the length of
the engine's run, then checks the story a container runtime would see: the server is
healthy at once, the pool is not ready until the worker allocated, the agent's health
check passes, the engine's traffic is served, and SIGTERM stops everyone cleanly.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsvc.demo.processes import Child, spawn, stop_all
from kvsvc.ports import is_unix_address
from kvsvc.server.app import pool_health_name
from tests.deploy.files import (
    COMPOSE,
    REPO,
    dockerfile_stages,
    effective,
    find_kind,
    flag_value,
    load_yaml,
    rewrite_flag,
    rewrite_listen,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None,
        reason="the worker agent needs torch (the worker extra)",
    ),
]

_METRICS_LINE = re.compile(r"metrics on http://[^\s:]+:(\d+)/metrics")
# `kvsvc serve` prints this line; at log level INFO its log also says "kvsvc serving on
# port N (metrics M)", which kvsvc.demo.processes.wait_for_ports can match first.
_SERVING_LINE = re.compile(r"^kvsvc serving on port (\d+)(?:, metrics on port (\d+))?$")


@dataclass(frozen=True)
class Scenario:
    """The commands one deployment runs (argv after the ``kvsvc`` entrypoint)."""

    server: list[str]
    worker: list[str]
    engine: list[str]  # a python command line
    server_healthcheck: list[str]
    agent_healthcheck: list[str]
    readiness_service: str


def engine_script_path(argv: list[str]) -> list[str]:
    """Map the image path of the demo engine to the repo file the Dockerfile copies there."""
    stages = dockerfile_stages()
    copies = {
        parts[1]: parts[0]
        for copy in stages["server"].find("COPY")
        if "--from=" not in copy.args and len(parts := copy.args.split()) == 2
    }
    return [str(REPO / copies[a]) if a in copies else a for a in argv]


def compose_scenario() -> Scenario:
    services = load_yaml(COMPOSE)["services"]
    stages = dockerfile_stages()
    engine = services["engine"]
    return Scenario(
        server=services["server"]["command"],
        worker=services["worker"]["command"],
        engine=engine_script_path([*engine["entrypoint"], *engine["command"]]),
        server_healthcheck=services["server"]["healthcheck"]["test"][1:],
        agent_healthcheck=effective(stages, "worker", "HEALTHCHECK").exec_form(),
        readiness_service=pool_health_name(flag_value(services["server"]["command"], "--pool")),
    )


def kubernetes_scenario() -> Scenario:
    (deployment,) = find_kind("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (sidecar,) = spec["initContainers"]
    containers = {c["name"]: c for c in spec["containers"]}
    stages = dockerfile_stages()
    return Scenario(
        server=sidecar["args"],
        worker=containers["worker"]["args"],
        engine=engine_script_path(
            [*containers["engine"]["command"], *containers["engine"]["args"]]
        ),
        server_healthcheck=effective(stages, "server", "HEALTHCHECK").exec_form(),
        agent_healthcheck=containers["worker"]["readinessProbe"]["exec"]["command"],
        readiness_service=sidecar["readinessProbe"]["grpc"]["service"],
    )


def python_command(argv: list[str]) -> list[str]:
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def healthcheck(argv: list[str], flag: str, address: str, service: str | None = None) -> int:
    command = rewrite_flag(python_command(argv), flag, address)
    if service is not None:
        command += ["--service", service]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return result.returncode


def wait_for_ports(server: Child) -> tuple[int, int]:
    """(gRPC port, metrics port or 0) from the server's 'kvsvc serving on port' line."""
    found: list[tuple[int, int]] = []

    def serving() -> bool:
        for line in list(server.lines):
            match = _SERVING_LINE.match(line)
            if match:
                found.append((int(match.group(1)), int(match.group(2) or 0)))
                return True
        return False

    wait_until(serving, 30, "the server to listen", server)
    return found[0]


def wait_until(predicate: object, timeout: float, what: str, child: Child) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        if not child.alive():
            raise AssertionError(f"{child.name} exited while waiting for {what}:\n{child.output()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{child.output()}")


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    stop_all(started)


@pytest.mark.parametrize(
    "scenario", [compose_scenario, kubernetes_scenario], ids=lambda f: f.__name__
)
def test_deployment_commands_run_and_report_health(
    scenario: object, children: list[Child], tmp_path: Path
) -> None:
    """The manifests' own commands, run here. Where the engine and its agent reach the
    server over its Unix socket (the Kubernetes sidecar), so do they here; the probes and
    the health checks of the server go over TCP, as in the pod."""
    s: Scenario = scenario()  # type: ignore[operator]
    socket = str(tmp_path / "kvsvc.sock")
    frames_socket = str(tmp_path / "frames.sock")
    server_argv = rewrite_listen(s.server, socket, frames_socket)
    server_argv = rewrite_flag(server_argv, "--metrics-listen", "127.0.0.1:0")
    server = spawn("server", server_argv)
    children.append(server)
    port, metrics_port = wait_for_ports(server)
    assert metrics_port, "the server was told to serve /metrics"
    tcp_address = f"127.0.0.1:{port}"
    # The engine's and the agent's address: the socket where the manifest gives one.
    address = f"unix:{socket}" if is_unix_address(flag_value(s.worker, "--server")) else tcp_address
    if is_unix_address(address):
        assert f"kvsvc listening on {address}" in server.output()
        assert healthcheck(s.server_healthcheck, "--server", address) == 0

    # The container is healthy (and Kubernetes' startup/liveness pass) as soon as it serves.
    assert healthcheck(s.server_healthcheck, "--server", tcp_address) == 0
    assert healthcheck(s.server_healthcheck, "--server", tcp_address, "") == 0
    # Readiness waits for the pool, which waits for its worker.
    assert healthcheck(s.server_healthcheck, "--server", tcp_address, s.readiness_service) == 1

    worker_argv = rewrite_flag(s.worker, "--server", address)
    worker_argv = rewrite_flag(worker_argv, "--metrics-listen", "127.0.0.1:0")
    worker = spawn("worker", worker_argv)
    children.append(worker)
    wait_until(lambda: _METRICS_LINE.search(worker.output()), 60, "the agent's metrics", worker)
    match = _METRICS_LINE.search(worker.output())
    assert match is not None
    agent_address = f"127.0.0.1:{match.group(1)}"
    wait_until(
        lambda: healthcheck(s.agent_healthcheck, "--agent-metrics", agent_address) == 0,
        60,
        "the agent's health check",
        worker,
    )
    wait_until(
        lambda: (
            healthcheck(s.server_healthcheck, "--server", tcp_address, s.readiness_service) == 0
        ),
        30,
        "the pool's readiness",
        server,
    )

    # The engine takes the framed socket where the manifest gives it one (the sidecar).
    engine_address = address
    if flag_value(s.engine, "--server").startswith("frames:unix:"):
        engine_address = f"frames:unix:{frames_socket}"
        assert f"kvsvc frames on unix:{frames_socket}" in server.output()
    engine_argv = rewrite_flag(python_command(s.engine), "--server", engine_address)
    engine_argv += ["--rounds", "1", "--requests", "20", "--step-interval", "0"]
    engine = subprocess.run(engine_argv, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert engine.returncode == 0, engine.stdout + engine.stderr
    assert "workload 1: 20 requests" in engine.stdout, engine.stdout

    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    pool = flag_value(s.server, "--pool")
    ok = re.search(rf'kvsvc_allocations_total\{{code="ok",pool="{pool}"\}} (\S+)', text)
    assert ok and float(ok.group(1)) >= 20, "the engine's allocations reached the server"

    # SIGTERM (docker stop, pod deletion): clean exits, workers first.
    assert worker.stop(grace=10) == 0, worker.output()
    assert server.stop(grace=10) == 0, server.output()


def test_demo_engine_frees_what_it_holds_on_sigterm(children: list[Child]) -> None:
    from kvsvc_client import KVCacheClient

    s = compose_scenario()
    server = spawn(
        "server",
        rewrite_flag(rewrite_flag(s.server, "--listen", "127.0.0.1:0"), "--metrics-listen", "off"),
    )
    children.append(server)
    port, _ = wait_for_ports(server)
    address = f"127.0.0.1:{port}"
    worker_argv = rewrite_flag(s.worker, "--server", address)
    children.append(spawn("worker", rewrite_flag(worker_argv, "--metrics-listen", "127.0.0.1:0")))
    pool = flag_value(s.server, "--pool")
    engine = subprocess.Popen(
        [*rewrite_flag(python_command(s.engine), "--server", address), "--step-interval", "0.01"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    try:
        with KVCacheClient(address, pool=pool) as kv:
            kv.wait_until_ready(timeout=60)
            deadline = time.monotonic() + 30
            while kv.usage().num_requests == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert kv.usage().num_requests > 0, "the engine admitted nothing"
            engine.send_signal(signal.SIGTERM)
            output, _ = engine.communicate(timeout=30)
            assert engine.returncode == 0, output
            assert "stopped" in output, output
            assert kv.usage().num_requests == 0, "the engine left requests holding blocks"
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
