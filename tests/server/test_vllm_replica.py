"""The engine-side replica of a pool (vLLM on kvsvc) against a real server, without vLLM.

The replica answers vLLM's scheduler from kvsvc's own core and sends the operations as one
Step per scheduling step; the server's reply is checked against the replica's answers.
These tests drive :class:`KvsvcPoolReplica` over real gRPC on a hybrid pool (sliding-window
and full-attention groups): the two copies agree through admissions with shared prefixes,
decodes past the window, preemptions and frees; a reply that differs from the replica's
answer in any column stops the engine with an error naming the server and pool; a forced
reset flags the replica for a resync, after which both copies agree again.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from kvsvc_client import KVCacheClient, RequestStart, StepResultList

from kvsvc.integrations.vllm import manager as manager_module
from kvsvc.integrations.vllm.config import settings_from_additional_config, vllm_kwargs
from kvsvc.integrations.vllm.manager import KvsvcError, KvsvcPoolReplica
from kvsvc.server.config import PoolConfig
from kvsvc.v1 import kvcache_pb2 as pb
from tests.server.harness import ServerThread, bring_up, hybrid_specs, running_server

POOL = "p"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    config = PoolConfig(name=POOL, world_size=1, max_model_len=160, num_gpu_blocks_override=24)
    with running_server(config) as thread:
        ranks = bring_up(
            thread, POOL, specs=hybrid_specs(block_size=16, window=40), kv_cache_bytes=16 << 20
        )
        yield thread
        for rank in ranks:
            rank.close()


def new_replica(server: ServerThread) -> KvsvcPoolReplica:
    plan = server.run(lambda: server.server.pools.by_name[POOL].plan)
    kwargs = vllm_kwargs(server.address, POOL)
    settings = settings_from_additional_config(kwargs["additional_config"])
    return KvsvcPoolReplica(
        replace(settings, rpc_timeout=10.0),
        config=plan.scheduler_config,
        block_size=plan.block_size,
        max_model_len=160,
        enable_caching=True,
    )


@pytest.fixture
def replica(server: ServerThread) -> Iterator[KvsvcPoolReplica]:
    engine = new_replica(server)
    yield engine
    for request_id in list(engine._num_sent):
        engine.free(request_id, preempted=False)
    engine.close()


def server_tables(server: ServerThread, request_id: str) -> tuple[list[int], ...]:
    with KVCacheClient(server.address, POOL) as client:
        return tuple(list(group) for group in client.block_table(request_id).groups)


def admit(engine: KvsvcPoolReplica, request_id: str, prompt: list[int], budget: int) -> Any:
    num_hit, hits = engine.lookup(prompt, None)
    assert engine.blocks_to_admit(request_id, num_hit + budget, hits, num_hit) >= 0
    return engine.admit(request_id, prompt, budget, 0, RequestStart())


def test_the_replica_and_the_server_agree_through_a_workload(
    server: ServerThread, replica: KvsvcPoolReplica
) -> None:
    rng = random.Random(3)
    shared = [rng.randrange(1000) for _ in range(70)]
    prompts = {f"r{i}": [*shared[: 20 + 11 * i], 2000 + i] for i in range(4)}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid, prompt in prompts.items():
        assert admit(replica, rid, prompt, len(prompt)) is not None
    replica.end_step()
    preempted = dropped = 0
    for step in range(50):
        replica.await_reply()
        for rid in list(replica._num_sent):
            tokens[rid].append(rng.randrange(1000))
            state = replica.cache.request_state(rid)
            assert state is not None
            if replica.allocate_running(rid, tokens[rid], state.num_computed_tokens, 1, 0) is None:
                replica.free(rid, preempted=True)
                preempted += 1
            else:
                dropped += replica.tables(rid)[0].count(0)
        if step == 20:
            replica.free("r0", preempted=False)  # its blocks stay cached for a resend
            assert admit(replica, "r0-again", prompts["r0"], len(prompts["r0"])) is not None
            tokens["r0-again"] = list(prompts["r0"])
        replica.end_step()
    replica.flush()
    assert not replica.needs_resync
    assert preempted and dropped, "the workload must preempt and drop window blocks"
    for rid in replica._num_sent:
        assert server_tables(server, rid) == tuple(list(t) for t in replica.tables(rid))
    with KVCacheClient(server.address, POOL) as client:
        assert client.usage().num_free_blocks == replica.num_free_blocks


def _sent_step(engine: KvsvcPoolReplica) -> tuple[Any, StepResultList]:
    """Send what is queued and take the prediction and the real reply, unchecked."""
    engine._send()
    in_flight = engine._in_flight
    assert in_flight is not None
    engine._in_flight = None
    future, prediction, _ = in_flight
    return prediction, future.result()


def _doctored(results: StepResultList, change: Any) -> StepResultList:
    response = type(results.response)()
    response.CopyFrom(results.response)
    change(response)
    return StepResultList(results._types, response)


@pytest.mark.parametrize(
    "what, change",
    [
        ("free count", lambda r: setattr(r, "num_free_blocks", r.num_free_blocks + 1)),
        ("block ids", lambda r: r.new_block_ids.__setitem__(0, r.new_block_ids[0] + 1)),
        ("hits", lambda r: r.num_cached_tokens.__setitem__(1, r.num_cached_tokens[1] - 16)),
        ("null blocks", lambda r: r.num_null_blocks.__setitem__(0, 1)),
        # Every other column as predicted: a NO_SPACE the replica did not predict means
        # the server did not append what vLLM would run (e.g. at max_pool_tokens).
        ("status", lambda r: r.statuses.__setitem__(1, pb.ALLOCATE_STATUS_NO_SPACE)),
    ],
)
def test_a_reply_that_differs_from_the_replica_stops_the_engine(
    server: ServerThread, replica: KvsvcPoolReplica, what: str, change: Any
) -> None:
    prompt = list(range(100, 180))
    assert admit(replica, "a", prompt, len(prompt)) is not None
    replica.end_step()
    replica.flush()
    replica.free("a", preempted=False)
    assert admit(replica, "b", [*prompt, 7], 81) is not None  # hits a's blocks
    prediction, results = _sent_step(replica)
    replica._check(prediction, results)  # the real reply agrees
    with pytest.raises(KvsvcError) as failure:
        replica._check(prediction, _doctored(results, change))
    message = str(failure.value)
    assert f"kvsvc server {server.address} (pool '{POOL}')" in message
    assert "diverged" in message


def test_a_pool_changed_behind_the_engines_back_stops_it_at_the_next_reply(
    server: ServerThread,
) -> None:
    """Another client takes blocks of the engine's pool between two steps: the next
    Step's reply (checked as it arrives, on the client's sender thread) differs from the
    replica's answers, and awaiting it stops the engine with the divergence named."""
    engine = new_replica(server)
    with KVCacheClient(server.address, POOL) as intruder:
        try:
            assert admit(engine, "c", list(range(600, 680)), 80) is not None
            engine.end_step()
            engine.await_reply()
            assert intruder.allocate("intruder", list(range(700, 740)), 40, start=True).ok
            assert admit(engine, "d", list(range(800, 840)), 40) is not None
            engine.end_step()
            with pytest.raises(KvsvcError, match="diverged"):
                engine.await_reply()
        finally:
            engine._client.close()  # the replica is past use: nothing more to send
            intruder.free("intruder", "c", "d")


def test_a_forced_reset_makes_the_replica_resync(
    server: ServerThread, replica: KvsvcPoolReplica
) -> None:
    prompt = list(range(300, 380))
    assert admit(replica, "x", prompt, len(prompt)) is not None
    replica.end_step()
    replica.await_reply()
    with KVCacheClient(server.address, POOL) as admin:
        assert admin.force_reset_prefix_cache()[0] == 1
    state = replica.cache.request_state("x")
    assert state is not None
    replica.allocate_running("x", [*prompt, 1], state.num_computed_tokens, 1, 0)
    # Admitted in the same step: the server caches its blocks under ids of its choosing,
    # which need not be where the engine wrote its KV.
    other = list(range(500, 560))
    assert admit(replica, "y", other, len(other)) is not None
    replica.end_step()
    replica.await_reply()
    assert replica.needs_resync
    for request_id in ("x", "y"):  # what the scheduler does: preempt everything
        replica.free(request_id, preempted=True)
    replica.resync()
    assert not replica.needs_resync and replica.stats.resyncs == 1
    # Nothing cached before the resync is a hit any more, on either copy.
    with KVCacheClient(server.address, POOL) as client:
        for tokens in ([*prompt, 5], [*other, 5]):
            assert replica.lookup(tokens, None)[0] == 0
            assert client.lookup(tokens) == 0
        assert client.usage().num_free_blocks == replica.num_free_blocks
    assert admit(replica, "x", [*prompt, 1], 82) is not None
    replica.flush()
    assert not replica.needs_resync
    assert server_tables(server, "x") == tuple(list(t) for t in replica.tables("x"))
    # The replica counted the invalidation it resynced from: a later reply that differs
    # for no reason the pool reports is a divergence again, not another silent resync.
    state = replica.cache.request_state("x")
    assert state is not None
    replica.allocate_running("x", [*prompt, 1, 2], state.num_computed_tokens, 1, 0)
    prediction, results = _sent_step(replica)
    replica._check(prediction, results)
    doctored = _doctored(results, lambda r: setattr(r, "num_free_blocks", r.num_free_blocks - 1))
    with pytest.raises(KvsvcError, match="diverged"):
        replica._check(prediction, doctored)
    assert not replica.needs_resync


def _server_computed(server: ServerThread, request_id: str) -> int:
    """The tokens the server's copy of the pool holds computed for ``request_id``."""
    pool = server.server.pools.by_name[POOL]
    return server.run(lambda: pool.cache.request_state(request_id).num_computed_tokens)


def _decode(engine: KvsvcPoolReplica, request_id: str, tokens: list[int], token: int) -> None:
    """One decode of ``request_id`` in a step: ``token`` appended to ``tokens`` and the
    slot allocated (queued for the server as vLLM's scheduler queues it)."""
    tokens.append(token)
    state = engine.cache.request_state(request_id)
    assert state is not None
    engine.allocate_running(request_id, tokens, state.num_computed_tokens, 1, 0)


def test_steps_per_call_holds_decode_steps_and_never_an_admission(server: ServerThread) -> None:
    """``steps_per_call=3``: a step that admits sends at once; the next steps' decodes wait
    until three steps' operations go in one Step (the server then agrees again); an idle
    engine's flush sends what waited; a free is held like a decode."""
    engine = new_replica(server)
    engine._steps_per_call = 3  # as settings_from_additional_config sets it
    try:
        prompt = list(range(900, 950))
        assert admit(engine, "h", prompt, len(prompt)) is not None
        engine.end_step()
        engine.await_reply()
        assert _server_computed(server, "h") == 50  # the admission went at once
        tokens = list(prompt)
        computed_by_step = []
        for _ in range(5):
            engine.await_reply()
            _decode(engine, "h", tokens, 7)
            engine.end_step()
            engine.await_reply()
            computed_by_step.append(_server_computed(server, "h"))
        # Steps 1 and 2 wait, step 3 sends all three; steps 4 and 5 wait again.
        assert computed_by_step == [50, 50, 53, 53, 53]
        assert list(engine.stats.rpcs_by_step)[-5:] == [0, 0, 1, 0, 0]
        engine.flush()
        assert _server_computed(server, "h") == 55
        assert list(engine.stats.steps_by_call) == [1, 3, 2]
        engine.free("h", preempted=False)
        engine.end_step()
        assert server.run(lambda: server.server.pools.by_name[POOL].cache.has_request("h"))
        engine.flush()
        assert not engine.needs_resync
        with KVCacheClient(server.address, POOL) as client:
            assert client.usage().num_free_blocks == engine.num_free_blocks
    finally:
        engine.close()


def test_steps_per_call_sends_once_the_held_operations_reach_the_limit(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held Step goes out once it holds HELD_OPERATIONS_LIMIT operations, whatever
    steps_per_call says (the server bounds a Step's operations)."""
    monkeypatch.setattr(manager_module, "HELD_OPERATIONS_LIMIT", 2)
    engine = new_replica(server)
    engine._steps_per_call = 16
    try:
        for request_id in ("m1", "m2"):
            assert admit(engine, request_id, list(range(40)), 40) is not None
        engine.end_step()
        tokens = list(range(40))
        held = []
        for _ in range(2):
            engine.await_reply()
            _decode(engine, "m1", tokens, 3)
            held.append(engine.end_step())
        assert held == [0, 1]  # one operation waits; the second step's makes two
        engine.free("m1", preempted=False)
        engine.free("m2", preempted=False)
        engine.flush()
        assert not engine.needs_resync
    finally:
        engine.close()


def test_held_steps_notice_a_forced_reset_when_they_go_and_resync(server: ServerThread) -> None:
    """``steps_per_call=3``: decodes held after an operator's forced reset reach the server
    with the third step, whose reply flags the request for recompute; the engine then
    preempts and resyncs as with every step sent, and both copies agree again."""
    engine = new_replica(server)
    engine._steps_per_call = 3
    try:
        prompt = list(range(1300, 1380))
        assert admit(engine, "z", prompt, len(prompt)) is not None
        engine.end_step()
        engine.await_reply()
        with KVCacheClient(server.address, POOL) as admin:
            assert admin.force_reset_prefix_cache()[0] == 1
        tokens = list(prompt)
        for _ in range(3):
            engine.await_reply()
            assert not engine.needs_resync  # held: the server has not answered them yet
            _decode(engine, "z", tokens, 1)
            engine.end_step()
        engine.await_reply()
        assert engine.needs_resync
        engine.free("z", preempted=True)
        engine.resync()
        assert not engine.needs_resync
        with KVCacheClient(server.address, POOL) as client:
            assert client.usage().num_requests == 0
            assert client.usage().num_free_blocks == engine.num_free_blocks
        assert admit(engine, "z", tokens, len(tokens)) is not None
        engine.end_step()
        engine.flush()
        assert not engine.needs_resync
        assert server_tables(server, "z") == tuple(list(t) for t in engine.tables("z"))
        engine.free("z", preempted=False)
        engine.flush()
    finally:
        engine.close()
