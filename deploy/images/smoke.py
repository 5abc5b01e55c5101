"""Smoke-test the built kvsvc images with podman: run them, and check what a user would.

    .venv/bin/python deploy/images/smoke.py          # after deploy/images/build.sh

Each check starts real containers from ``kvsvc:server`` and ``kvsvc:worker`` (KVSVC_IMAGE
changes the repository name) and removes them after:

- the server with the image's own command, its ports published on loopback: ``podman
  healthcheck run`` healthy, ``kvsvc ctl pools`` from this host (the Python running this
  script must have kvsvc: the repository's .venv) lists the pool, every process of the
  container runs as UID 10001;
- a worker container with the image's own command (its ``server`` host name pointed at the
  server container) joins the pool until ``kvsvc ctl wait-ready`` sees it READY; then both
  health checks are healthy and the agent's /metrics answers on its published port;
- the server started with ``serve --listen 0.0.0.0:6000``: the health check follows the
  port (healthy), while a check of the old fixed port 50051 fails there;
- where podman-compose is installed (Debian's package; 1.0.3 with bookworm's podman
  4.3), deploy/compose.yaml: its server, worker, engine and Prometheus up, the pool READY,
  the engine service served, both health checks healthy, Prometheus scraping the server
  and the agent. :func:`local_compose` says what changes for a machine without registry
  access (build.sh's images, a Debian Prometheus, no Grafana, free host ports).

podman runs without systemd in containers and CI VMs, so health checks never run on a
timer: ``podman healthcheck run`` runs the image's HEALTHCHECK once (its systemd timer
warnings on stderr are harmless). CONTAINERS_CONF defaults to deploy/images/containers.conf
as in build.sh. Exit status 0 when every check passed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
UID = 10001
IMAGE = os.environ.get("KVSVC_IMAGE", "kvsvc")
SERVER_IMAGE = f"{IMAGE}:server"
WORKER_IMAGE = f"{IMAGE}:worker"
# The images' ports (the Dockerfile's EXPOSE and default commands).
GRPC_PORT, METRICS_PORT, AGENT_METRICS_PORT = 50051, 9400, 9401
# The pool of the images' default commands.
POOL = "demo"


class SmokeError(AssertionError):
    """A check failed; the message says what was seen (and the container's log)."""


def podman_env() -> dict[str, str]:
    """The environment for podman: CONTAINERS_CONF as given, else this directory's file."""
    env = dict(os.environ)
    env.setdefault("CONTAINERS_CONF", str(HERE / "containers.conf"))
    return env


def podman(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``podman ARGS``; raise SmokeError with its output when ``check`` and it fails."""
    result = subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=podman_env(), timeout=timeout
    )
    if check and result.returncode != 0:
        raise SmokeError(
            f"podman {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
        )
    return result


def kvsvc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kvsvc ARGS`` from this host (this interpreter's kvsvc), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", *args], capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    """A loopback port nothing listens on now (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, logs: Callable[[], str]
) -> None:
    """Poll ``predicate`` until true; SmokeError naming ``what`` with ``logs()`` after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise SmokeError(f"timed out after {timeout:g} s waiting for {what}\n{logs()}")


@dataclass
class Container:
    """A running container started by :func:`run_container`."""

    name: str
    ports: dict[int, int] = field(default_factory=dict)  # container port -> host port

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return f"--- podman logs {self.name}:\n{result.stdout}{result.stderr}"

    def running(self) -> bool:
        result = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return result.stdout.strip() == "true"

    def ip(self) -> str:
        """Its address on podman's default network (where other containers reach it)."""
        result = podman("inspect", "--format", "{{.NetworkSettings.IPAddress}}", self.name)
        address = result.stdout.strip()
        if not address:
            raise SmokeError(f"{self.name} has no IP address on the default network")
        return address

    def healthcheck(self) -> tuple[bool, str]:
        """Run the image's HEALTHCHECK once (``podman healthcheck run``): healthy, output."""
        result = podman("healthcheck", "run", self.name, check=False, timeout=60)
        return result.returncode == 0, (result.stdout + result.stderr).strip()

    def health_status(self) -> str:
        """The health status podman recorded ("healthy", "unhealthy", "starting")."""
        result = podman("inspect", "--format", "{{json .State}}", self.name)
        state = json.loads(result.stdout)
        health = state.get("Health") or state.get("Healthcheck") or {}
        return str(health.get("Status", ""))

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return podman("exec", self.name, *argv, check=False, timeout=60)

    def process_uids(self) -> dict[str, list[int]]:
        """``{pid: [real, effective, saved, fs uid]}`` of every process in the container but
        the one reading them (inside its PID namespace: right for rootless podman too)."""
        script = (
            "import os, json, pathlib\n"
            "me = str(os.getpid())\n"
            "out = {}\n"
            "for p in pathlib.Path('/proc').iterdir():\n"
            "    if p.name.isdigit() and p.name != me:\n"
            "        try:\n"
            "            status = (p / 'status').read_text()\n"
            "        except OSError:\n"
            "            continue\n"
            "        line = next(l for l in status.splitlines() if l.startswith('Uid:'))\n"
            "        out[p.name] = [int(v) for v in line.split()[1:]]\n"
            "print(json.dumps(out))\n"
        )
        result = self.exec("python", "-c", script)
        if result.returncode != 0:
            raise SmokeError(f"reading {self.name}'s processes failed: {result.stderr}")
        return {pid: list(uids) for pid, uids in json.loads(result.stdout).items()}


@contextmanager
def run_container(
    image: str,
    command: Sequence[str] = (),
    *,
    publish: Sequence[int] = (),
    add_hosts: dict[str, str] | None = None,
    role: str = "kvsvc",
) -> Iterator[Container]:
    """Start ``image`` (its own command unless ``command``), ``publish`` ports on loopback
    (free host ports), remove it after, whatever happened."""
    name = f"kvsvc-smoke-{role}-{secrets.token_hex(3)}"
    container = Container(name, {port: free_port() for port in publish})
    argv = ["run", "-d", "--name", name]
    for port, host_port in container.ports.items():
        argv += ["--publish", f"127.0.0.1:{host_port}:{port}"]
    for host, address in (add_hosts or {}).items():
        argv += ["--add-host", f"{host}:{address}"]
    try:
        podman(*argv, image, *command)
        yield container
    finally:
        podman("rm", "--force", "--time", "5", name, check=False, timeout=60)


def wait_healthy(container: Container, timeout: float = 60) -> None:
    """Run the HEALTHCHECK until it passes (the process may still be starting)."""
    last: list[str] = []

    def healthy() -> bool:
        if not container.running():
            raise SmokeError(f"{container.name} exited\n{container.logs()}")
        ok, output = container.healthcheck()
        last[:] = [output]
        return ok

    wait_for(
        healthy,
        timeout,
        f"{container.name}'s health check",
        lambda: f"last health check output: {last[0] if last else '-'}\n{container.logs()}",
    )
    status = container.health_status()
    if status != "healthy":
        raise SmokeError(f"{container.name}: podman records health {status!r} after a pass")


def check_uids(container: Container) -> None:
    uids = container.process_uids()
    if not uids:
        raise SmokeError(f"{container.name}: no process found")
    wrong = {pid: ids for pid, ids in uids.items() if set(ids) != {UID}}
    if wrong:
        raise SmokeError(f"{container.name}: processes not running as UID {UID}: {wrong}")


def ctl_pools(container: Container) -> str:
    """``kvsvc ctl pools`` against the container's published gRPC port."""
    result = kvsvc("ctl", "--server", f"127.0.0.1:{container.ports[GRPC_PORT]}", "pools")
    if result.returncode != 0:
        raise SmokeError(f"kvsvc ctl pools failed: {result.stderr}\n{container.logs()}")
    return result.stdout


def pool_state(pools_output: str, pool: str = POOL) -> str:
    """The STATE column of ``pool``'s row in ``kvsvc ctl pools`` output."""
    for line in pools_output.splitlines():
        fields = line.split()
        if fields[:1] == [pool] and len(fields) > 1:
            return fields[1]
    raise SmokeError(f"pool {pool!r} is not in kvsvc ctl pools:\n{pools_output}")


def check_server_default(server: Container) -> None:
    """The image's own command: healthy, reachable from the host, UID 10001."""
    wait_healthy(server)
    state = pool_state(ctl_pools(server))
    if state not in ("WAITING_FOR_WORKERS", "READY"):
        raise SmokeError(f"pool {POOL} is {state} before any worker")
    check_uids(server)
    with urllib.request.urlopen(
        f"http://127.0.0.1:{server.ports[METRICS_PORT]}/metrics", timeout=10
    ) as response:
        text = response.read().decode()
    waiting = rf'^kvsvc_pool_state\{{[^}}]*pool="{POOL}"[^}}]*state="{state}"[^}}]*\}} 1(\.0)?$'
    if not re.search(waiting, text, re.MULTILINE):
        raise SmokeError(f"the server's published /metrics does not say pool {POOL} is {state}")


def check_worker_joins(server: Container, worker: Container) -> None:
    """The worker's own command reaches the server; the pool turns READY; both healthy."""
    address = f"127.0.0.1:{server.ports[GRPC_PORT]}"
    result = kvsvc("ctl", "--server", address, "wait-ready", POOL, "--timeout", "180", timeout=200)
    if result.returncode != 0:
        raise SmokeError(
            f"pool {POOL} not READY: {result.stdout}{result.stderr}\n{worker.logs()}\n"
            f"{server.logs()}"
        )
    if pool_state(ctl_pools(server)) != "READY":
        raise SmokeError("wait-ready returned but kvsvc ctl pools does not say READY")
    wait_healthy(worker, timeout=60)
    wait_healthy(server)
    check_uids(worker)
    url = f"http://127.0.0.1:{worker.ports[AGENT_METRICS_PORT]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    if not re.search(r"^kvsvc_agent_ready\{[^}]*\} 1(\.0)?$", text, re.MULTILINE):
        raise SmokeError(f"{url}: kvsvc_agent_ready is not 1")


def check_health_follows_listen(server: Container, port: int) -> None:
    """A server told ``--listen 0.0.0.0:PORT``: its HEALTHCHECK asks PORT, not 50051."""
    wait_healthy(server)
    fixed = server.exec("python", "-m", "kvsvc.tools.healthcheck", "--server", "127.0.0.1:50051")
    if fixed.returncode == 0:
        raise SmokeError("something answers on 50051: the check does not prove the port moved")
    result = kvsvc("ctl", "--server", f"127.0.0.1:{server.ports[port]}", "pools")
    if result.returncode != 0 or POOL not in result.stdout:
        raise SmokeError(f"kvsvc ctl pools on the moved port failed: {result.stderr}")


OTHER_PORT = 6000

# ---------------------------------------------------------------- compose
COMPOSE = HERE.parent / "compose.yaml"
PROMETHEUS_IMAGE = "localhost/prometheus:bookworm"  # build.sh prometheus


def local_compose(source: Path, image: str, project: str) -> tuple[dict[str, Any], dict[int, int]]:
    """deploy/compose.yaml changed only where this machine needs it, and the host ports.

    The kvsvc services use ``image``'s tags as they are (no ``build``: podman-compose then
    never builds, and the Dockerfile's public base is not pulled); Prometheus runs
    build.sh's local Debian image with the same flags and files; Grafana is left out (no
    image without a registry); host ports become free ports on loopback and relative
    paths absolute. Returns the compose document and container port -> host port.
    """
    import yaml

    compose = yaml.safe_load(source.read_text())
    compose["name"] = project
    services = compose["services"]
    for name in ("server", "worker", "engine"):
        target = services[name].pop("build")["target"]
        services[name]["image"] = f"{image}:{target}"
    services["prometheus"]["image"] = PROMETHEUS_IMAGE
    services.pop("grafana")
    compose["volumes"].pop("grafana-data")
    ports: dict[int, int] = {}
    for service in services.values():
        published = []
        for entry in service.get("ports", []):
            container = str(entry).rpartition(":")[2]
            ports[int(container)] = free_port()
            published.append(f"127.0.0.1:{ports[int(container)]}:{container}")
        if published:
            service["ports"] = published
        service["volumes"] = [
            f"{(source.parent / v.split(':', 1)[0]).resolve()}:{v.split(':', 1)[1]}"
            if v.startswith(".")
            else v
            for v in service.get("volumes", [])
        ]
    return compose, ports


@dataclass
class ComposeProject:
    """A compose project started by :func:`compose_up`."""

    name: str
    file: Path
    ports: dict[int, int]  # container port -> host port

    def container(self, service: str) -> Container:
        return Container(f"{self.name}_{service}_1")

    def logs(self) -> str:
        return "\n".join(self.container(s).logs() for s in ("server", "worker", "engine"))


def podman_compose(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman-compose", *args],
        capture_output=True,
        text=True,
        env=podman_env(),
        timeout=timeout,
    )


@contextmanager
def compose_up(image: str, workdir: Path, source: Path = COMPOSE) -> Iterator[ComposeProject]:
    """``podman-compose up -d`` of :func:`local_compose`'s file; ``down -v`` after."""
    import yaml

    name = f"kvsvc-smoke-{secrets.token_hex(3)}"
    compose, ports = local_compose(source, image, name)
    file = workdir / "compose.yaml"
    file.write_text(yaml.safe_dump(compose, sort_keys=False))
    project = ComposeProject(name, file, ports)
    try:
        result = podman_compose("-f", str(file), "-p", name, "up", "-d")
        if result.returncode != 0:
            raise SmokeError(f"podman-compose up failed:\n{result.stdout}{result.stderr}")
        yield project
    finally:
        podman_compose("-f", str(file), "-p", name, "down", "-v", "-t", "5")
        podman("network", "rm", "--force", f"{name}_default", check=False)


def prometheus_api(project: ComposeProject, path: str) -> Any:
    url = f"http://127.0.0.1:{project.ports[9090]}{path}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())["data"]


def check_compose(project: ComposeProject) -> None:
    """The stack of deploy/compose.yaml: the pool READY, the engine served, both health
    checks healthy, Prometheus scraping the server and the agent."""
    server = Container(project.container("server").name, {GRPC_PORT: project.ports[GRPC_PORT]})
    result = kvsvc(
        "ctl", "--server", f"127.0.0.1:{project.ports[GRPC_PORT]}", "wait-ready", POOL,
        "--timeout", "180", timeout=200,
    )  # fmt: skip
    if result.returncode != 0:
        raise SmokeError(f"pool {POOL} not READY: {result.stdout}{result.stderr}\n{project.logs()}")
    engine = project.container("engine")
    wait_for(
        lambda: f"pool '{POOL}' is READY" in engine.logs() and "workload 1:" in engine.logs(),
        180,
        "the engine service to see the pool READY and finish a workload",
        project.logs,
    )
    wait_healthy(server)
    wait_healthy(project.container("worker"))

    def scraped() -> bool:
        try:
            targets = prometheus_api(project, "/api/v1/targets")["activeTargets"]
        except OSError:
            return False
        return {t["labels"]["job"]: t["health"] for t in targets} == {
            "kvsvc-server": "up",
            "kvsvc-worker": "up",
        }

    wait_for(scraped, 60, "Prometheus to scrape kvsvc-server and kvsvc-worker", project.logs)
    for query, job in (
        (f'kvsvc_pool_state{{pool="{POOL}",state="READY"}}', "kvsvc-server"),
        ("kvsvc_agent_ready", "kvsvc-worker"),
    ):

        def answered(query: str = query, job: str = job) -> bool:
            found = prometheus_api(project, f"/api/v1/query?query={urllib.parse.quote(query)}")
            return [(r["metric"]["job"], r["value"][1]) for r in found["result"]] == [(job, "1")]

        wait_for(answered, 30, f"Prometheus to hold {query} = 1 from {job}", project.logs)


def other_port_command() -> list[str]:
    """The image's server command with the gRPC port moved to OTHER_PORT."""
    return [
        "serve",
        "--listen",
        f"0.0.0.0:{OTHER_PORT}",
        "--metrics-listen",
        f"0.0.0.0:{METRICS_PORT}",
        "--pool",
        POOL,
        "--world-size",
        "1",
        "--max-model-len",
        "4096",
    ]


def main() -> int:
    checks = 0
    start = time.monotonic()
    with run_container(SERVER_IMAGE, publish=(GRPC_PORT, METRICS_PORT), role="server") as server:
        check_server_default(server)
        print(f"ok: {SERVER_IMAGE} (its own command) healthy, ctl pools, UID {UID}")
        checks += 1
        with run_container(
            WORKER_IMAGE,
            publish=(AGENT_METRICS_PORT,),
            add_hosts={"server": server.ip()},
            role="worker",
        ) as worker:
            check_worker_joins(server, worker)
            print(f"ok: {WORKER_IMAGE} joined: pool {POOL} READY, both healthy, UID {UID}")
            checks += 1
    with run_container(
        SERVER_IMAGE, other_port_command(), publish=(OTHER_PORT,), role="server-6000"
    ) as moved:
        check_health_follows_listen(moved, OTHER_PORT)
        print(f"ok: {SERVER_IMAGE} with --listen 0.0.0.0:{OTHER_PORT}: health follows the port")
        checks += 1
    if shutil.which("podman-compose"):
        with tempfile.TemporaryDirectory() as workdir, compose_up(IMAGE, Path(workdir)) as project:
            check_compose(project)
            print("ok: deploy/compose.yaml with podman-compose: READY, engine served, scraped")
            checks += 1
    else:
        print("skipped: deploy/compose.yaml (podman-compose is not installed)")
    print(f"{checks} checks passed in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SmokeError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
