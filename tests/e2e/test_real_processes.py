"""The mission's shape with real processes on loopback: `kvsvc serve`, two `kvsvc worker`
agents (TP=2, CPU tensors) and the engine client.

Checks the issue's "done when": the plan each agent received matches `kvsvc plan` for the
same inputs, tensors exist with the planned shapes, prefix reuse through the client,
NO_SPACE then success after frees, error codes that leave usage unchanged, an agent killed
and restarted gets its plan back, and health flips per pool.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvsvc_client import (
    AllocateStatus,
    AlreadyExistsError,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    NotReadyError,
    PoolInfo,
)

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from kvsvc.server.app import KVCACHE_SERVICE, pool_health_name

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

MODEL = "llama-3.2-1b"
TP = 2
MEMORY = "64MiB"
MAX_MODEL_LEN = 1024
# llama-3.2-1b: 16 layers, 8 KV heads of 64 -> 4 per rank at TP=2; bf16; 16-token blocks.
HEADS_PER_RANK, HEAD_SIZE, BLOCK = 4, 64, 16


@dataclass
class Cluster:
    address: str
    server: Child
    workers: list[Child]

    def worker_args(self, rank: int) -> list[str]:
        return [
            "worker", "--server", self.address, "--pool", "e2e", "--rank", str(rank),
            "--world-size", str(TP), "--device", "cpu", "--model-config", MODEL,
            "--tp", str(TP), "--kv-cache-memory", MEMORY, "--heartbeat-interval", "0.5",
        ]  # fmt: skip


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def pool_info(kv: KVCacheClient, name: str = "e2e") -> PoolInfo:
    return next(p for p in kv.list_pools() if p.name == name)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = tmp_path_factory.mktemp("e2e") / "pools.json"
    config.write_text(
        json.dumps(
            {
                "pools": [
                    {"name": "e2e", "world_size": TP, "max_model_len": MAX_MODEL_LEN},
                    {"name": "idle", "world_size": 1, "max_model_len": MAX_MODEL_LEN},
                ]
            }
        )
    )
    server = spawn(
        "server",
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--config",
            str(config),
            "--log-level",
            "WARNING",
            "--heartbeat-timeout",
            "3",
        ],
    )
    port, _ = wait_for_ports(server)
    cluster = Cluster(f"127.0.0.1:{port}", server, [])
    try:
        assert health(cluster.address, pool_health_name("e2e")) == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )
        cluster.workers = [spawn(f"worker{r}", cluster.worker_args(r)) for r in range(TP)]
        with KVCacheClient(cluster.address, pool="e2e") as kv:
            kv.wait_until_ready(timeout=120)
        yield cluster
    finally:
        stop_all([server, *cluster.workers])


@pytest.fixture
def kv(cluster: Cluster) -> Iterator[KVCacheClient]:
    with KVCacheClient(cluster.address, pool="e2e") as client:
        yield client


def test_plan_matches_kvsvc_plan_for_the_same_inputs(kv: KVCacheClient) -> None:
    served = json.loads(kv.get_plan().plan_json)
    offline = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvsvc",
                "plan",
                "--model-config",
                MODEL,
                "--tp",
                str(TP),
                "--kv-cache-memory",
                MEMORY,
                "--max-model-len",
                str(MAX_MODEL_LEN),
                "--json",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert served["state"] == "READY"
    for key in ("num_blocks", "block_size", "max_model_len", "kv_cache_tokens", "max_concurrency"):
        assert served[key] == offline[key], key
    assert served["groups"] == offline["groups"]
    assert served["workers"] == offline["workers"]


def test_agents_hold_tensors_with_the_planned_shapes(kv: KVCacheClient) -> None:
    response = kv.get_plan()
    plan = json.loads(response.plan_json)
    num_blocks = plan["num_blocks"]
    layers = plan["groups"][0]["layer_names"]
    assert len(layers) == 16
    for worker in response.pool.workers:
        assert worker.allocated
        assert worker.allocated_bytes == plan["workers"][worker.rank]["allocated_bytes"]
        views = {v.layer_name: v for v in worker.views}
        assert set(views) == set(layers)
        for view in views.values():
            # The default ("flash") layout: blocks first, K/V, tokens, heads, head size.
            assert list(view.shape) == [num_blocks, 2, BLOCK, HEADS_PER_RANK, HEAD_SIZE]
            assert view.dtype == "bfloat16"


def test_prefix_reuse_across_requests(kv: KVCacheClient) -> None:
    system = list(range(100, 100 + 64))
    first = kv.allocate("p1", [*system, 1, 2, 3], num_new_tokens=512, start=True)
    second = kv.allocate("p2", [*system, 7, 8, 9], num_new_tokens=512, start=True)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    assert second.new_block_ids[0][:4] == first.new_block_ids[0][:4]
    assert kv.lookup([*system, 5]) == 64
    kv.free("p1", "p2")


def test_no_space_then_success_after_frees(kv: KVCacheClient) -> None:
    usage = kv.usage()
    per_request = MAX_MODEL_LEN  # 64 blocks each
    held = []
    for i in range(usage.num_blocks // (per_request // BLOCK)):
        prompt = [10_000 + i * per_request + j for j in range(per_request)]
        assert kv.allocate(f"fill{i}", prompt, num_new_tokens=per_request, start=True).ok
        held.append(f"fill{i}")
    rest = kv.usage().num_free_blocks * BLOCK  # top up the last blocks exactly
    if rest:
        assert kv.allocate("rest", [20_000 + j for j in range(rest)], rest, start=True).ok
        held.append("rest")
    before = kv.usage()
    assert before.num_free_blocks == 0
    denied = kv.allocate("late", [1] * 128, num_new_tokens=128, start=True)
    assert denied.status is AllocateStatus.NO_SPACE
    assert kv.usage().num_free_blocks == before.num_free_blocks
    kv.free(*held)
    assert kv.allocate("late", [1] * 128, num_new_tokens=128, start=True).ok
    kv.free("late")


def test_errors_return_their_codes_and_change_nothing(cluster: Cluster, kv: KVCacheClient) -> None:
    kv.allocate("live", list(range(40)), num_new_tokens=40, start=True)
    before = kv.usage()
    with pytest.raises(InvalidArgumentError, match="num_new_tokens"):
        kv.allocate("x", [1, 2], num_new_tokens=-3, start=True)
    with pytest.raises(InvalidArgumentError, match="new_token_ids"):
        kv.allocate("x", [1, 2**31], num_new_tokens=2, start=True)
    with pytest.raises(InvalidArgumentError, match="max_model_len"):
        kv.allocate("live", [1], num_new_tokens=MAX_MODEL_LEN)
    with pytest.raises(AlreadyExistsError, match="already live"):
        kv.allocate("live", [1], num_new_tokens=1, start=True)
    with pytest.raises(NotFoundError):
        kv.allocate("ghost", [1], num_new_tokens=1)
    with KVCacheClient(cluster.address, pool="idle") as idle, pytest.raises(NotReadyError):
        idle.allocate("x", [1], num_new_tokens=1, start=True)
    after = kv.usage()
    assert (after.num_free_blocks, after.num_requests) == (
        before.num_free_blocks,
        before.num_requests,
    )
    assert kv.block_table("live").num_computed_tokens == 40
    kv.free("live")


def test_health_is_per_pool(cluster: Cluster) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert health(cluster.address, "") == serving
    assert health(cluster.address, pool_health_name("e2e")) == serving
    assert health(cluster.address, pool_health_name("idle")) == not_serving
    # Not every pool is ready, so the service as a whole is not.
    assert health(cluster.address, KVCACHE_SERVICE) == not_serving


def test_a_killed_agent_restarted_gets_its_plan_back(cluster: Cluster, kv: KVCacheClient) -> None:
    plan_before = json.loads(kv.get_plan().plan_json)
    victim = cluster.workers[1]
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(10)
    wait_for(lambda: pool_info(kv).state == "DEGRADED", what="DEGRADED after the kill")
    # A degraded pool still serves engine calls.
    assert kv.allocate("during", [1, 2, 3], num_new_tokens=3, start=True).ok
    kv.free("during")
    cluster.workers[1] = spawn("worker1-again", cluster.worker_args(1))
    wait_for(lambda: pool_info(kv).state == "READY", what="READY after the restart")
    plan_after = json.loads(kv.get_plan().plan_json)
    assert plan_after["workers"] == plan_before["workers"]
    assert plan_after["num_blocks"] == plan_before["num_blocks"]
    rank1 = next(w for w in kv.get_plan().pool.workers if w.rank == 1)
    assert rank1.allocated
