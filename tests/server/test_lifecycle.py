"""Pool lifecycle over the real WorkerService: registration, planning, readiness, health."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvsvc_client import KVCacheClient

from kvsvc.server.app import pool_health_name
from kvsvc.server.config import PoolConfig
from kvsvc.specs import FullAttentionSpec
from kvsvc.v1 import pools_pb2
from tests.server.harness import FakeRank, hybrid_specs, llama_like_specs, running_server

BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16
MiB = 1 << 20


def health_status(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def test_states_and_health_follow_the_ranks() -> None:
    pool = PoolConfig(name="tp2", world_size=2, max_model_len=256)
    with running_server(pool) as srv:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_status(srv.address, "") == serving
        assert health_status(srv.address, pool_health_name("tp2")) == not_serving
        r0, r1 = (
            FakeRank(srv.address, "tp2", r, 2, llama_like_specs(), 40 * BYTES_PER_BLOCK)
            for r in (0, 1)
        )
        assert r0.register().state == pools_pb2.POOL_STATE_WAITING_FOR_WORKERS
        r0.open_stream()
        assert r0.next_update().state == pools_pb2.POOL_STATE_WAITING_FOR_WORKERS
        r1.register()
        r1.open_stream()
        for rank in (r0, r1):
            update = rank.wait_for_config()
            assert update.state == pools_pb2.POOL_STATE_PLANNED
            assert rank.config.num_blocks == 40
        assert r0.report().state == pools_pb2.POOL_STATE_PLANNED
        assert r1.report().state == pools_pb2.POOL_STATE_READY
        wait_for(lambda: health_status(srv.address, pool_health_name("tp2")) == serving)
        assert health_status(srv.address, "kvsvc.v1.KVCacheService") == serving

        # The agent of rank 1 dies: its plan stream closes, the pool degrades but serves.
        r1.close()
        with KVCacheClient(srv.address, pool="tp2") as kv:
            wait_for(lambda: next(p for p in kv.list_pools()).state == "DEGRADED")
            assert kv.allocate("a", list(range(20)), 20, start=True).ok
        # A new agent takes rank 1 over and gets the very same plan back.
        again = FakeRank(srv.address, "tp2", 1, 2, llama_like_specs(), 40 * BYTES_PER_BLOCK)
        again.register()
        again.open_stream()
        again.wait_for_config()
        assert again.config == r1.config
        assert again.report().state == pools_pb2.POOL_STATE_READY
        for rank in (r0, again):
            rank.close()


def test_duplicate_rank_of_a_live_agent_is_refused() -> None:
    with running_server(PoolConfig(name="p", world_size=2, max_model_len=64)) as srv:
        first = FakeRank(srv.address, "p", 0, 2, llama_like_specs(), 8 * MiB)
        first.register()
        first.open_stream()
        first.next_update()
        second = FakeRank(srv.address, "p", 0, 2, llama_like_specs(), 8 * MiB)
        with pytest.raises(grpc.RpcError) as err:
            second.register()
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "rank 0" in err.value.details()
        first.close()
        second.close()


@pytest.mark.parametrize(
    ("rank", "world_size", "field"),
    [(2, 2, "rank"), (-1, 2, "rank"), (0, 3, "world_size")],
)
def test_rank_and_world_size_are_validated(rank: int, world_size: int, field: str) -> None:
    with running_server(PoolConfig(name="p", world_size=2, max_model_len=64)) as srv:
        agent = FakeRank(srv.address, "p", rank, world_size, llama_like_specs(), 8 * MiB)
        with pytest.raises(grpc.RpcError) as err:
            agent.register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field)
        with KVCacheClient(srv.address, pool="p") as kv:
            assert kv.list_pools()[0].num_registered == 0
        agent.close()


def test_specs_that_disagree_across_ranks_are_refused() -> None:
    with running_server(PoolConfig(name="p", world_size=2, max_model_len=64)) as srv:
        good = FakeRank(srv.address, "p", 0, 2, llama_like_specs(), 8 * MiB)
        good.register()
        other = llama_like_specs()
        other["model.layers.1.self_attn.attn"] = FullAttentionSpec(
            block_size=16, num_kv_heads=4, head_size=64, dtype="float16"
        )
        bad = FakeRank(srv.address, "p", 1, 2, other, 8 * MiB)
        with pytest.raises(grpc.RpcError) as err:
            bad.register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model.layers.1.self_attn.attn" in err.value.details()
        assert "rank 0" in err.value.details()
        good.close()
        bad.close()


def test_memory_too_small_is_reported_to_agents_and_in_get_plan() -> None:
    with running_server(PoolConfig(name="p", world_size=1, max_model_len=4096)) as srv:
        agent = FakeRank(srv.address, "p", 0, 1, llama_like_specs(), 10 * BYTES_PER_BLOCK)
        agent.register()
        agent.open_stream()
        update = agent.wait_for_config()
        assert update.state == pools_pb2.POOL_STATE_WAITING_FOR_WORKERS
        assert "max_model_len" in update.error or "max seq len" in update.error
        assert "8.00 MiB" in update.error and "--max-model-len" in update.error
        with KVCacheClient(srv.address, pool="p") as kv:
            info = kv.list_pools()[0]
            assert info.state == "WAITING_FOR_WORKERS"
            assert info.num_registered == 0  # nothing half-planned
            plan = json.loads(kv.get_plan().plan_json)
            assert plan["state"] == "WAITING_FOR_WORKERS"
            assert "8.00 MiB" in plan["error"]
        agent.close()


def test_get_plan_matches_what_agents_received() -> None:
    with running_server(PoolConfig(name="h", world_size=1, max_model_len=128)) as srv:
        agent = FakeRank(srv.address, "h", 0, 1, hybrid_specs(), 4 * MiB)
        agent.register()
        agent.open_stream()
        agent.wait_for_config()
        with KVCacheClient(srv.address, pool="h") as kv:
            response = kv.get_plan()
            plan = json.loads(response.plan_json)
            assert plan["state"] == "PLANNED"
            assert plan["num_blocks"] == agent.config.num_blocks
            assert {g["kind"] for g in plan["groups"]} == {"full_attention", "sliding_window"}
            assert len(response.worker_configs) == 1
        agent.close()


def test_heartbeat_timeout_degrades_the_pool() -> None:
    with running_server(
        PoolConfig(name="p", world_size=1, max_model_len=64), heartbeat_timeout_s=0.4
    ) as srv:
        agent = FakeRank(srv.address, "p", 0, 1, llama_like_specs(), 8 * MiB)
        agent.register()
        agent.open_stream()
        agent.wait_for_config()
        agent.report()
        with KVCacheClient(srv.address, pool="p") as kv:
            assert kv.list_pools()[0].state == "READY"
            wait_for(lambda: kv.list_pools()[0].state == "DEGRADED", timeout=5)
            assert agent.heartbeat().state == pools_pb2.POOL_STATE_READY
            assert kv.list_pools()[0].state == "READY"
        agent.close()


def test_heartbeat_with_a_stale_session_asks_to_reregister() -> None:
    with running_server(PoolConfig(name="p", world_size=1, max_model_len=64)) as srv:
        agent = FakeRank(srv.address, "p", 0, 1, llama_like_specs(), 8 * MiB)
        agent.session_id = "not-a-session"
        assert agent.heartbeat().reregister is True
        agent.close()
