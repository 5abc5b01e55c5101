"""Real redis-server processes for the cluster tests: one server, or a 3-node cluster.

Each runs in its own temporary directory without persistence (``--save ''``,
``--appendonly no``): a restart loses everything, the harshest case for the indexer.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.tooling import free_port as tooling_free_port
from tests.tooling import missing, require_tool

INSTALL = "apt-get install redis-server (it brings redis-cli; .ci/run installs it)"


def require_redis_package() -> None:
    """Skip (locally) or fail (CI) without the redis client package (the cluster extra)."""
    try:
        import redis  # noqa: F401
    except ImportError:
        missing("the redis package", "pip install -e '.[cluster]' (make venv installs it)")


def free_port(cluster_bus: bool = False) -> int:
    """A free port; with ``cluster_bus`` one whose cluster bus port (port + 10000, Redis
    Cluster's rule) is a free port too."""
    return tooling_free_port(also_free_at=10000 if cluster_bus else 0)


class RedisServer:
    """One redis-server on 127.0.0.1, restartable on the same port."""

    def __init__(self, directory: Path, port: int | None = None, cluster: bool = False) -> None:
        self.binary = require_tool("redis-server", f"the cluster index tests need it: {INSTALL}")
        self.cli = require_tool("redis-cli", f"the cluster tests need it: {INSTALL}")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster_bus=cluster)
        self.cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            self.binary,
            "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.directory), "--protected-mode", "no",
        ]  # fmt: skip
        if self.cluster:
            # A fresh node each start: no nodes.conf kept from a previous run.
            (self.directory / "nodes.conf").unlink(missing_ok=True)
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        log = self.directory / "redis.log"
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, cwd=self.directory
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.ping():
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")

    def ping(self) -> bool:
        result = subprocess.run(
            [self.cli, "-p", str(self.port), "ping"], capture_output=True, text=True, timeout=5
        )
        return result.stdout.strip() == "PONG"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def create_cluster(nodes: list[RedisServer]) -> None:
    """``redis-cli --cluster create`` over the started nodes (no replicas), then wait until
    every node says the cluster is ok."""
    cli = nodes[0].cli
    addresses = [f"127.0.0.1:{n.port}" for n in nodes]
    subprocess.run(
        [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = [
            subprocess.run(
                [cli, "-p", str(n.port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            for n in nodes
        ]
        if all("cluster_state:ok" in s for s in states):
            return
        time.sleep(0.1)
    raise RuntimeError("the Redis Cluster did not become ok")


@contextmanager
def redis_deployment(base: Path, kind: str) -> Iterator[str]:
    """A running Redis of ``kind`` ("single": one server; "cluster": a 3-node Redis
    Cluster) under ``base``; yields the URL to connect to (a node's, for a cluster)."""
    if kind == "single":
        servers = [RedisServer(base / "0")]
    elif kind == "cluster":
        servers = [RedisServer(base / str(i), cluster=True) for i in range(3)]
    else:
        raise ValueError(f"unknown Redis deployment {kind!r} (single or cluster)")
    for server in servers:
        server.start()
    try:
        if kind == "cluster":
            create_cluster(servers)
        yield servers[0].url
    finally:
        for server in servers:
            server.stop()
