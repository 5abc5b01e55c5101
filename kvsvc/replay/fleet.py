"""The replay's processes: Redis, one ``kvsvc serve`` per engine, the indexer and the router.

Each simulated engine has its own ``kvsvc serve`` (as a sidecar would), with one pool of
exactly ``kv_tokens / block_size`` blocks. The engine's GPU is simulated, so its rank
registers over the real Worker API and reports the plan allocated without tensors (the
server serves a pool whose rank holds none alike; a real engine's agent would allocate
them): no torch, and no memory spent on a KV cache nothing reads. ``kvsvc indexer``
follows every pool's events and load into Redis, and ``kvsvc router`` answers Route from
there, with the weights given.

Without ``--redis`` the replay starts a private ``redis-server`` (no persistence, a free
port, a temporary directory) and stops it at the end; with one, its keys live under a
prefix of their own, deleted at the end.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsvc.cluster.route import RoutePolicy
from kvsvc.convert import layer_specs_to_pb
from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from kvsvc.specs import FullAttentionSpec
from kvsvc.v1 import worker_pb2, worker_pb2_grpc

POOL = "engine"
HEARTBEAT_S = 2.0
START_TIMEOUT_S = 60.0
_ROUTER_PORT = re.compile(r"kvsvc router serving on port (\d+)")


class FleetError(RuntimeError):
    """A process of the fleet did not start (the message has its output)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of the replay's own: no persistence, a free port, a temporary
    directory."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FleetError(
                "kvsvc replay needs redis-server on PATH (apt-get install redis-server), or "
                "--redis URL of a running one"
            )
        self.dir = tempfile.mkdtemp(prefix="kvsvc-replay-redis-")
        self.port = free_port()
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}"
        from kvsvc.cluster.store import connect

        deadline = time.monotonic() + 10
        while True:
            try:
                connect(self.url, cluster=False, timeout=1).ping()
                return
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise FleetError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


class SimulatedRank:
    """The pool's one rank, for an engine whose GPU is simulated: it registers a layer of
    ``block_size`` over the Worker API, takes its plan and reports it allocated (without
    tensors), then heartbeats."""

    def __init__(self, address: str, block_size: int, num_blocks: int, max_model_len: int):
        import grpc

        self.channel = grpc.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32"
        )
        self.page_bytes = spec.page_size_bytes
        memory = (num_blocks + 1) * self.page_bytes  # the null block too
        reply = self.stub.Register(
            worker_pb2.RegisterRequest(
                pool=POOL, rank=0, world_size=1, device="cpu", hostname="replay",
                layers=layer_specs_to_pb({"layer.0": spec}),
                memory=worker_pb2.MemoryProfile(total_bytes=memory, kv_cache_bytes=memory),
                max_model_len=max_model_len, model="kvsvc-replay",
            ),
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        self.session = reply.session_id
        stream = self.stub.WatchPlan(
            worker_pb2.WatchPlanRequest(pool=POOL, rank=0, session_id=self.session)
        )
        try:
            for update in stream:
                if update.error:
                    raise FleetError(f"{address}: planning failed: {update.error}")
                if update.HasField("config"):
                    planned = update.config.num_blocks
                    break
        finally:
            stream.cancel()
        self.stub.ReportAllocation(
            worker_pb2.ReportAllocationRequest(
                pool=POOL, rank=0, session_id=self.session, num_blocks=planned,
                allocated_bytes=planned * self.page_bytes, memory_free_bytes=0,
            ),
            timeout=START_TIMEOUT_S,
        )  # fmt: skip

    def heartbeat(self) -> None:
        self.stub.Heartbeat(
            worker_pb2.HeartbeatRequest(pool=POOL, rank=0, session_id=self.session), timeout=10
        )

    def close(self) -> None:
        self.channel.close()


class Fleet:
    """E ``kvsvc serve`` (one pool each), ``kvsvc indexer`` and ``kvsvc router``.

    Args:
        engines: how many.
        block_size: tokens per block of every pool.
        num_blocks: usable blocks of each pool.
        max_model_len: the pools' longest request.
        redis_url: the index's Redis.
        key_prefix: the index's keys' prefix.
        policy: Route's weights (the router's defaults).
        load_interval_s / load_ttl_s: the indexer's load reports.
        workdir: where the seed file goes.
    """

    def __init__(
        self,
        engines: int,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        redis_url: str,
        key_prefix: str,
        policy: RoutePolicy,
        load_interval_s: float,
        load_ttl_s: float,
        workdir: Path,
    ) -> None:
        self.engines = engines
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.policy = policy
        self.load_interval_s = load_interval_s
        self.load_ttl_s = load_ttl_s
        self.seed_file = workdir / "hash-seed"
        if not self.seed_file.exists():
            self.seed_file.write_text(uuid.uuid4().hex + "\n")
            self.seed_file.chmod(0o600)
        self.addresses: list[str] = []
        self.router_address = ""
        self._servers: list[Child] = []
        self._others: list[Child] = []
        self._ranks: list[SimulatedRank] = []
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    @property
    def sources(self) -> list[str]:
        return [f"{a}/{POOL}" for a in self.addresses]

    def start(self) -> None:
        """Start everything and wait until the index lists every engine with its load.

        Raises:
            FleetError: a process did not start (its output in the message).
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        for i in range(self.engines):
            self._servers.append(
                spawn(f"engine{i}", [
                    "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off",
                    "--pool", POOL, "--max-model-len", str(self.max_model_len),
                    "--num-gpu-blocks-override", str(self.num_blocks + 1),
                    "--hash-seed-file", str(self.seed_file), "--log-level", "WARNING",
                ])
            )  # fmt: skip
        for server in self._servers:
            try:
                port, _ = wait_for_ports(server, START_TIMEOUT_S)
            except (RuntimeError, TimeoutError) as exc:
                raise FleetError(f"kvsvc serve ({server.name}): {exc}") from None
            self.addresses.append(f"127.0.0.1:{port}")
        for address in self.addresses:
            self._ranks.append(
                SimulatedRank(address, self.block_size, self.num_blocks, self.max_model_len)
            )
        self._beat = threading.Thread(target=self._heartbeats, name="replay-beat", daemon=True)
        self._beat.start()
        indexer_args = ["indexer", "--redis", self.redis_url, "--key-prefix", self.key_prefix]
        for source in self.sources:
            indexer_args += ["--source", source]
        indexer_args += [
            "--load-interval", f"{self.load_interval_s:g}", "--load-ttl", f"{self.load_ttl_s:g}",
            "--metrics-listen", "off", "--log-level", "WARNING",
        ]  # fmt: skip
        self._others.append(spawn("indexer", indexer_args))
        self._others.append(
            spawn("router", [
                "router", "--redis", self.redis_url, "--key-prefix", self.key_prefix,
                "--hash-seed-file", str(self.seed_file), "--listen", "127.0.0.1:0",
                "--prefix-weight", f"{self.policy.prefix_weight!r}",
                "--load-weight", f"{self.policy.load_weight!r}",
                "--load-floor", f"{self.policy.load_floor!r}", "--log-level", "WARNING",
            ])
        )  # fmt: skip
        self.router_address = f"127.0.0.1:{self._wait_router(self._others[-1])}"
        self._wait_indexed()

    def _wait_router(self, router: Child) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in list(router.lines):
                match = _ROUTER_PORT.search(line)
                if match:
                    return int(match.group(1))
            if not router.alive():
                router.stop()
                raise FleetError(f"kvsvc router exited: {router.output()}")
            time.sleep(0.05)
        raise FleetError(f"kvsvc router did not start: {router.output()}")

    def _wait_indexed(self) -> None:
        """Until the registry lists every engine and each has a load report."""
        from kvsvc.cluster.layout import Keys
        from kvsvc.cluster.load import parse_vector
        from kvsvc.cluster.store import connect, read_registry

        keys = Keys(self.key_prefix)
        client = connect(self.redis_url)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            registry = read_registry(client, keys)
            if set(registry.engines) >= set(self.sources):
                vector = client.get(keys.load)
                ids = [registry.engines[s][0] for s in self.sources]
                if all(parse_vector(vector, i) is not None for i in ids):
                    return
            indexer = self._others[0]
            if not indexer.alive():
                indexer.stop()
                raise FleetError(f"kvsvc indexer exited: {indexer.output()}")
            time.sleep(0.1)
        raise FleetError(f"the indexer did not index every engine: {self._others[0].output()}")

    def _heartbeats(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for rank in self._ranks:
                # A server that stopped: the replay says so on its own calls.
                with contextlib.suppress(Exception):
                    rank.heartbeat()

    def output(self) -> str:
        """The last lines of every process (for an error message)."""
        return "\n".join(f"[{c.name}] {c.output()}" for c in (*self._servers, *self._others))

    def stop(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(5)
        for rank in self._ranks:
            rank.close()
        stop_all([*self._servers, *self._others])


def delete_keys(redis_url: str, prefix: str, patterns: Sequence[str] = ("*",)) -> int:
    """Delete the replay's keys (``prefix``...) from a Redis it was given."""
    from kvsvc.cluster.store import connect

    client: Any = connect(redis_url)
    deleted = 0
    for pattern in patterns:
        keys = list(client.scan_iter(match=f"{prefix}{pattern}", count=1000))
        for start in range(0, len(keys), 1000):
            pipe = client.pipeline(transaction=False)
            for key in keys[start : start + 1000]:  # one key a command: any slot
                pipe.delete(key)
            deleted += sum(int(n) for n in pipe.execute())
    return deleted
