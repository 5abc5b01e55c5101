"""The agent against a real gRPC WorkerService on loopback (a minimal in-test servicer).

register -> plan -> allocate -> report -> heartbeat; a server restart (same port, fresh
state) makes the agents register again and keep their tensors; every fatal answer stops
the agent with the server's message.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

torch = pytest.importorskip("torch")

from kvsvc.errors import InvalidArgument  # noqa: E402
from kvsvc.specs import FullAttentionSpec, KVCacheSpec  # noqa: E402
from kvsvc.worker import (  # noqa: E402
    WorkerAgent,
    WorkerAgentConfig,
    WorkerAgentError,
    backoff_delay,
)

from .fake_server import FakeServer, FakeWorkerService  # noqa: E402

pytestmark = pytest.mark.torch

MiB = 1 << 20
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
PAGE = SPEC.page_size_bytes  # 8 KiB
SPECS: dict[str, KVCacheSpec] = {f"model.layers.{i}.self_attn.attn": SPEC for i in range(4)}
LAYER0 = "model.layers.0.self_attn.attn"


def wait_for(predicate: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll until ``predicate()`` holds; the deadline is generous (a busy CI box stalls)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def make_agent(address: str, rank: int = 0, world_size: int = 1, **overrides) -> WorkerAgent:  # type: ignore[no-untyped-def]
    specs = overrides.pop("specs", SPECS)
    kwargs = {
        "device": "cpu",
        "kv_cache_memory": 4 * MiB,  # 128 blocks of 4 layers x 8 KiB
        "heartbeat_interval": 0.05,
        "backoff_initial": 0.02,
        "backoff_max": 0.2,
        "rpc_timeout": 5.0,
        **overrides,
    }
    config = WorkerAgentConfig(server=address, pool="p", rank=rank, world_size=world_size, **kwargs)
    return WorkerAgent(config, specs)


def sample(agent: WorkerAgent, name: str) -> float | None:
    return agent.metrics.registry.get_sample_value(
        name, {"pool": "p", "rank": str(agent._cfg.rank)}
    )


def test_two_ranks_register_get_the_plan_allocate_report_and_heartbeat() -> None:
    """Both ranks come up and heartbeat; robust on a busy box (it failed once under load).

    Every check of something another thread does waits for it with a generous deadline
    instead of reading it once: the agent counts a heartbeat after the server's reply
    arrives (so the server may count 2 while the agent still shows 1), and it sets its
    ready gauge just after waking the thread that start() returns on. Deadlines and the
    RPC timeout are long because a loaded 2-core machine can stall a thread for seconds;
    they cost nothing when things are quick.
    """
    patience = 60.0
    with FakeServer(FakeWorkerService(world_size=2)) as server:
        agents = [make_agent(server.address, rank, 2, rpc_timeout=30.0) for rank in range(2)]
        try:
            with ThreadPoolExecutor(2) as pool:
                results = list(pool.map(lambda a: a.start(timeout=patience), agents))
            for rank, (agent, views) in enumerate(zip(agents, results, strict=True)):
                assert set(views) == set(SPECS)
                assert views[LAYER0].shape == (128, 2, 16, 2, 64)
                report = server.service.reports[rank]
                assert report.num_blocks == 128
                assert report.allocated_bytes == 4 * 128 * PAGE == agent.allocated_bytes
                assert [v.layer_name for v in report.views] == list(SPECS)
                assert list(report.views[0].shape) == [128, 2, 16, 2, 64]
                assert report.views[0].dtype == "float16"
                registration = server.service.registrations[rank]
                assert registration.memory.kv_cache_bytes == 4 * MiB
                assert registration.device == "cpu" and len(registration.layers) == 4
            wait_for(
                lambda: all(server.service.heartbeats.get(r, 0) >= 2 for r in range(2)), patience
            )
            wait_for(lambda: all(a.state == "READY" for a in agents), patience)
            for agent in agents:
                wait_for(
                    lambda a=agent: (sample(a, "kvsvc_agent_heartbeats_total") or 0) >= 2, patience
                )
                wait_for(lambda a=agent: sample(a, "kvsvc_agent_ready") == 1, patience)
                assert agent.ready and agent.max_model_len == 256
                assert sample(agent, "kvsvc_agent_num_blocks") == 128
                assert sample(agent, "kvsvc_agent_tensor_bytes") == 4 * 128 * PAGE
                assert sample(agent, "kvsvc_agent_kv_cache_offered_bytes") == 4 * MiB
            # One session each: no heartbeat timed out into a re-registration.
            assert len(server.service.registrations) == 2
        finally:
            for agent in agents:
                agent.stop()


def test_a_restarted_server_gets_the_same_plan_and_the_agent_keeps_its_tensors() -> None:
    server = FakeServer(FakeWorkerService())
    agent = make_agent(server.address)
    try:
        views = agent.start(timeout=10)
        pointer = views[LAYER0].data_ptr()
        views[LAYER0][5].fill_(1.5)
        server.stop()
        wait_for(lambda: (sample(agent, "kvsvc_agent_heartbeat_failures_total") or 0) >= 1)
        wait_for(lambda: not agent.ready)
        server = FakeServer(FakeWorkerService(), port=server.port)  # fresh state, same port
        wait_for(lambda: 0 in server.service.reports)
        wait_for(lambda: agent.ready)
        # It first tried to resume the lost session, which the new server does not know.
        assert len(server.service.registrations) == 1
        assert agent.kv_caches is not None
        assert agent.kv_caches[LAYER0].data_ptr() == pointer
        assert bool((agent.kv_caches[LAYER0][5] == 1.5).all())  # the bytes survived
        assert sample(agent, "kvsvc_agent_reconnects_total") == 1
        assert server.service.reports[0].num_blocks == 128
        wait_for(lambda: server.service.heartbeats.get(0, 0) >= 1)
    finally:
        agent.stop()
        server.stop()


def test_a_broken_connection_resumes_the_session_the_server_still_holds() -> None:
    with FakeServer(FakeWorkerService()) as server:
        agent = make_agent(server.address)
        try:
            views = agent.start(timeout=10)
            session = agent.session_id
            server.service.break_streams()  # the link drops; the server keeps the session
            wait_for(lambda: len(server.service.watch_calls) == 2 and agent.ready)
            assert server.service.watch_calls == [session, session]
            assert len(server.service.registrations) == 1  # no second Register
            assert agent.session_id == session
            assert agent.kv_caches is not None
            assert agent.kv_caches[LAYER0].data_ptr() == views[LAYER0].data_ptr()
            assert sample(agent, "kvsvc_agent_reconnects_total") == 1
        finally:
            agent.stop()


def test_a_heartbeat_answered_reregister_makes_the_agent_register_again() -> None:
    with FakeServer(FakeWorkerService()) as server:
        agent = make_agent(server.address)
        try:
            agent.start(timeout=10)
            first_session = agent.session_id
            server.service.forget(0)  # the plan stream stays open: only the heartbeat tells
            wait_for(lambda: len(server.service.registrations) == 2)
            wait_for(lambda: agent.ready and agent.session_id != first_session)
            assert server.service.sessions[0] == agent.session_id
            assert sample(agent, "kvsvc_agent_reconnects_total") == 1
        finally:
            agent.stop()


@pytest.mark.parametrize(
    ("service", "overrides", "code", "message"),
    [
        (FakeWorkerService(pool="other"), {}, "NOT_FOUND", 'unknown pool "p"'),
        (FakeWorkerService(world_size=3), {}, "INVALID_ARGUMENT", 'world_size: pool "p" has 3'),
        (FakeWorkerService(token="s3cret"), {}, "UNAUTHENTICATED", "bearer token"),
        (
            FakeWorkerService(max_model_len=8192),
            {"kv_cache_memory": 256 * 1024},
            "PLAN_FAILED",
            r"planning pool 'p' failed: .*estimated maximum model length is 112",
        ),
    ],
    ids=["unknown-pool", "bad-world-size", "no-token", "plan-failed"],
)
def test_fatal_answers_stop_the_agent_with_the_servers_message(
    service: FakeWorkerService, overrides: dict[str, object], code: str, message: str
) -> None:
    with FakeServer(service) as server:
        agent = make_agent(server.address, world_size=1, **overrides)
        started = time.monotonic()
        with pytest.raises(WorkerAgentError, match=message) as info:
            agent.start(timeout=10)
        assert info.value.code == code
        assert time.monotonic() - started < 5
        assert agent.error is not None and agent.error.code == code


def test_the_token_is_sent_as_a_bearer_header() -> None:
    with FakeServer(FakeWorkerService(token="s3cret")) as server:
        agent = make_agent(server.address, auth_token="s3cret")
        try:
            assert agent.start(timeout=10)
        finally:
            agent.stop()


def test_a_rank_held_by_another_agent_is_fatal_at_first_registration() -> None:
    with FakeServer(FakeWorkerService(world_size=2)) as server:
        holder = make_agent(server.address, 0, 2)
        intruder = make_agent(server.address, 0, 2)
        try:
            holder.launch()
            wait_for(lambda: holder.session_id is not None)
            with pytest.raises(WorkerAgentError, match="held by a live agent") as info:
                intruder.start(timeout=10)
            assert info.value.code == "ALREADY_EXISTS"
        finally:
            holder.stop()


def test_a_report_the_server_calls_invalid_is_fatal() -> None:
    service = FakeWorkerService()
    service.report_error = (grpc.StatusCode.INVALID_ARGUMENT, "num_blocks: 127 but 128")
    with FakeServer(service) as server:
        agent = make_agent(server.address)
        with pytest.raises(WorkerAgentError, match="ReportAllocation: num_blocks") as info:
            agent.start(timeout=10)
        assert info.value.code == "INVALID_ARGUMENT"


def test_start_times_out_while_other_ranks_are_missing() -> None:
    with FakeServer(FakeWorkerService(world_size=2)) as server:
        agent = make_agent(server.address, 0, 2)
        with pytest.raises(WorkerAgentError, match=r"1/2 ranks registered") as info:
            agent.start(timeout=0.3)
        assert info.value.code == "TIMEOUT"
        assert all(not t.is_alive() for t in agent._threads)


def test_an_unreachable_server_fails_after_the_connect_timeout() -> None:
    server = FakeServer(FakeWorkerService())
    server.stop()
    agent = make_agent(server.address, connect_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(WorkerAgentError, match="no session with") as info:
        agent.start(timeout=10)
    assert info.value.code == "UNREACHABLE"
    assert 0.4 < time.monotonic() - started < 5


def test_an_engine_that_bound_its_tensors_refuses_a_new_plan() -> None:
    service = FakeWorkerService()
    with FakeServer(service) as server:
        agent = make_agent(server.address)
        try:
            agent.start(timeout=10)
            config = service.configs[0]  # type: ignore[index]
            smaller = type(config)(
                num_blocks=64,
                kv_cache_tensors=[
                    type(t)(size=64 * PAGE, shared_by=t.shared_by) for t in config.kv_cache_tensors
                ],
                kv_cache_groups=config.kv_cache_groups,
            )
            service.replan([smaller])
            assert agent.wait(5)
            assert agent.error is not None and agent.error.code == "REPLANNED"
        finally:
            agent.stop()


def test_a_standalone_agent_reallocates_for_a_new_plan() -> None:
    service = FakeWorkerService()
    with FakeServer(service) as server:
        agent = make_agent(server.address, allow_replan=True)
        try:
            agent.start(timeout=10)
            config = service.configs[0]  # type: ignore[index]
            smaller = type(config)(
                num_blocks=64,
                kv_cache_tensors=[
                    type(t)(size=64 * PAGE, shared_by=t.shared_by) for t in config.kv_cache_tensors
                ],
                kv_cache_groups=config.kv_cache_groups,
            )
            service.replan([smaller])
            wait_for(lambda: 0 in service.reported and service.reports[0].num_blocks == 64)
            assert agent.kv_caches is not None
            assert agent.kv_caches[LAYER0].shape[0] == 64
            assert agent.allocated_bytes == 4 * 64 * PAGE
        finally:
            agent.stop()


def test_bad_agent_arguments_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match=r"^rank: must be in \[0, 2\)"):
        make_agent("127.0.0.1:1", rank=2, world_size=2)
    with pytest.raises(InvalidArgument, match=r"^device: expected cpu, cuda or cuda:N"):
        make_agent("127.0.0.1:1", device="tpu")
    # The framed transport serves engine calls only: an agent is told to use gRPC's address.
    with pytest.raises(InvalidArgument, match=r"^server: .*framed transport.*--listen"):
        make_agent("frames:unix:/run/kvsvc/frames.sock")
    with pytest.raises(InvalidArgument, match=r"shared_layers\[x\].*not a layer"):
        WorkerAgent(
            WorkerAgentConfig(server="127.0.0.1:1", pool="p", rank=0, world_size=1),
            SPECS,
            shared_layers={"x": "nope"},
        )
    with pytest.raises(InvalidArgument, match=r"attn_layout\[nope\]: no layer"):
        WorkerAgent(
            WorkerAgentConfig(server="127.0.0.1:1", pool="p", rank=0, world_size=1),
            SPECS,
            attn_layouts={"nope": "flash"},
        )
    # A budget that does not fit is the documented WorkerAgentError, worded for the
    # Python caller (the config's field, not kvsvc worker's --kv-cache-memory).
    agent = make_agent("127.0.0.1:1", kv_cache_memory=None)
    with pytest.raises(WorkerAgentError) as raised:
        agent.start(timeout=1)
    assert raised.value.code == "MEMORY"
    assert str(raised.value) == (
        "kv_cache_memory: required on cpu (there is no profiler): give kv_cache_memory "
        "(WorkerAgentConfig), e.g. 4 << 30 for 4 GiB"
    )
    assert agent.wait(timeout=0)  # stopped: nothing left running


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(n, 0.1, 1.0, rng) for n in range(8)]
    for n, delay in enumerate(delays):
        base = min(1.0, 0.1 * 2**n)
        assert base / 2 <= delay <= base
    assert max(delays) <= 1.0
    assert backoff_delay(10_000, 0.1, 1.0, rng) <= 1.0
