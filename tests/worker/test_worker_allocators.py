"""The agent's allocation hook: an engine that allocates its own KV cache hands it over.

``WorkerAgent(..., allocator=EngineTensors(...))`` against the loopback WorkerService: the
engine reads the plan, hands its tensors over and the agent reports them; a restarted server
hears the same tensors' identity; stopping ends a wait for them; a later plan is refused in
the engine's words.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from kvsvc.errors import InvalidArgument  # noqa: E402
from kvsvc.specs import KVCacheConfig  # noqa: E402
from kvsvc.worker import (  # noqa: E402
    EngineTensors,
    KVCacheView,
    WorkerAgent,
    WorkerAgentConfig,
)

from .fake_server import FakeServer, FakeWorkerService  # noqa: E402
from .test_worker_agent import LAYER0, PAGE, SPECS, MiB, wait_for  # noqa: E402

pytestmark = pytest.mark.torch


def engine_agent(address: str, tensors: EngineTensors) -> WorkerAgent:
    config = WorkerAgentConfig(
        server=address,
        pool="p",
        rank=0,
        world_size=1,
        kv_cache_memory=4 * MiB,  # 128 blocks of 4 layers x 8 KiB
        heartbeat_interval=0.05,
        rpc_timeout=5.0,
    )
    return WorkerAgent(config, SPECS, allocator=tensors)


def engine_caches(num_blocks: int) -> dict[str, KVCacheView]:
    """What the engine allocated for the plan: one blocks-first tensor per layer."""
    return {name: torch.zeros(num_blocks, 2, 16, 2, 64, dtype=torch.float16) for name in SPECS}


def launch_and_hand_over(address: str) -> tuple[WorkerAgent, KVCacheConfig]:
    """An engine's agent, launched, whose engine allocated for the plan and handed its
    tensors over; returns it (ready) and the plan. The caller stops it."""
    tensors = EngineTensors("test-engine")
    agent = engine_agent(address, tensors)
    agent.launch()
    try:
        plan = agent.wait_plan(timeout=30)
        tensors.hand_over(engine_caches(plan.num_blocks), 4 * 128 * PAGE)
        agent.wait_ready(timeout=30)
    except BaseException:
        agent.stop()
        raise
    return agent, plan


def test_the_engine_reads_the_plan_hands_its_tensors_over_and_they_are_reported() -> None:
    with FakeServer(FakeWorkerService()) as server:
        tensors = EngineTensors("test-engine")
        agent = engine_agent(server.address, tensors)
        agent.launch()
        try:
            plan = agent.wait_plan(timeout=30)
            assert plan.num_blocks == 128 and agent.plan == plan
            assert agent.kv_caches is None and not server.service.reported
            caches = engine_caches(plan.num_blocks)
            tensors.hand_over(caches, 4 * 128 * PAGE)
            views = agent.wait_ready(timeout=30)
            assert views[LAYER0] is caches[LAYER0]
            assert agent.kv_cache_config == plan and agent.raw_tensors is None
            report = server.service.reports[0]
            assert report.num_blocks == 128 and report.allocated_bytes == 4 * 128 * PAGE
            assert len(report.allocation_id) == 32  # the engine's tensors have an identity
            assert list(report.views[0].shape) == [128, 2, 16, 2, 64]
        finally:
            agent.stop()


def test_a_restarted_server_hears_the_same_identity_of_the_engine_s_tensors() -> None:
    """The engine's tensors outlive a server restart: the rank registers again naming them
    as before, so a server that kept its state keeps the pool's cached blocks (a new
    identity would make it drop them, as for a new engine process)."""
    server = FakeServer(FakeWorkerService())
    agent, _ = launch_and_hand_over(server.address)
    try:
        identity = server.service.reports[0].allocation_id
        assert identity
        server.stop()
        wait_for(lambda: not agent.ready)
        server = FakeServer(FakeWorkerService(), port=server.port)  # fresh state, same port
        wait_for(lambda: agent.ready and 0 in server.service.reports)
        assert [r.allocation_id for r in server.service.registrations] == [identity]
        assert server.service.reports[0].allocation_id == identity
    finally:
        agent.stop()
        server.stop()


def test_stopping_ends_the_wait_for_the_engine_s_tensors() -> None:
    with FakeServer(FakeWorkerService()) as server:
        agent = engine_agent(server.address, EngineTensors())
        agent.launch()
        agent.wait_plan(timeout=30)
        started = time.monotonic()
        agent.stop(timeout=10)
        assert time.monotonic() - started < 5
        assert agent.wait(0) and agent.error is None and agent.kv_caches is None


def test_another_plan_after_the_hand_over_is_refused_in_the_engine_s_words() -> None:
    service = FakeWorkerService()
    with FakeServer(service) as server:
        agent, plan = launch_and_hand_over(server.address)
        try:
            tensors_of_64 = [replace(t, size=64 * PAGE) for t in plan.kv_cache_tensors]
            service.replan([replace(plan, num_blocks=64, kv_cache_tensors=tensors_of_64)])
            assert agent.wait(10)
            assert agent.error is not None and agent.error.code == "REPLANNED"
            assert "after test-engine allocated its KV cache" in str(agent.error)
        finally:
            agent.stop()


def test_an_allocator_of_its_own_takes_no_layout_arguments() -> None:
    config = WorkerAgentConfig(server="127.0.0.1:1", pool="p", rank=0, world_size=1)
    with pytest.raises(InvalidArgument, match=r"^allocator: "):
        WorkerAgent(config, SPECS, attn_layouts={LAYER0: "kv_first"}, allocator=EngineTensors())
