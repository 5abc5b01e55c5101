"""The replies kept for retries by ``call_id`` (issue 32, item 3).

1,100 zero-op Steps with fresh call ids and ``free_queue_head_limit=65536`` took a server
from 108 to 333 MB, its snapshot from 2.6 to 187 MB, and a restart from that snapshot to
776 MB: every reply was kept, read-only ones included, and only their number was bounded.
Now only a call that changed the pool is kept (a repeat of one that changed nothing is
the same call applied once), serialized, within bytes per caller and per pool; a
caller's burst evicts its own oldest replies, not another engine's; a snapshot holds
exactly what is kept.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvsvc_client import ClientOptions, KVCacheClient

from kvsvc.server.calls import (
    CALL_LOG_CALLER_BYTES,
    CALL_LOG_POOL_BYTES,
    CallLog,
    entry_cost,
)
from kvsvc.server.config import PoolConfig
from kvsvc.server.persistence.records import JournalKind, SnapshotCapture
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import ServerThread, bring_up, running_server

STEP = JournalKind.STEP
ENGINE_A = "engine-a-token-0123456789"
ENGINE_B = "engine-b-token-0123456789"


def reply(n: int) -> bytes:
    return kvcache_pb2.StepResponse(free_queue_head=range(1, n + 1)).SerializeToString()


def test_a_caller_is_bounded_by_its_entries_and_its_bytes() -> None:
    log = CallLog(per_caller_entries=3, per_caller_bytes=10_000, pool_bytes=100_000)
    for i in range(5):
        log.put("a", f"c{i}", STEP, reply(10), 0)
    assert len(log) == 3
    assert log.get("a", "c1", STEP) is None and log.get("a", "c2", STEP) is not None
    big = reply(2000)  # ~4 KB each: two fit in 10,000 bytes with their bookkeeping
    for i in range(4):
        log.put("a", f"big{i}", STEP, big, 0)
    assert log.engine_bytes("a") <= 10_000
    assert [log.get("a", f"big{i}", STEP) is not None for i in range(4)] == [
        False, False, True, True,
    ]  # fmt: skip
    # A reply larger than a caller's whole budget is not kept (its repeat applies again).
    log.put("a", "huge", STEP, reply(5000), 0)
    assert log.get("a", "huge", STEP) is None and log.get("a", "big3", STEP) is not None
    assert log.num_bytes == log.engine_bytes("a")


def test_one_callers_burst_does_not_evict_anothers_replies() -> None:
    log = CallLog(per_caller_entries=1024, per_caller_bytes=20_000, pool_bytes=60_000)
    log.put("b", "kept", STEP, reply(100), 0)
    for i in range(2000):
        log.put("a", f"c{i}", STEP, reply(100), 0)
    assert log.get("b", "kept", STEP) is not None
    assert log.engine_bytes("a") <= 20_000
    # The pool's bound holds across callers: the oldest go first, whoever made them.
    for engine in "cdef":
        for i in range(100):
            log.put(engine, f"c{i}", STEP, reply(100), 0)
    assert log.num_bytes <= 60_000
    assert sum(log.engine_bytes(e) for e in "abcdef") == log.num_bytes
    assert log.get("b", "kept", STEP) is None


def test_saved_replies_load_within_the_bounds() -> None:
    big = CallLog(per_caller_entries=1024, per_caller_bytes=1 << 30, pool_bytes=1 << 30)
    for i in range(50):
        big.put("a", f"c{i}", STEP, reply(1000), 0)
    small = CallLog(per_caller_entries=1024, per_caller_bytes=30_000, pool_bytes=1 << 30)
    small.load_state(big.to_state())
    assert small.engine_bytes("a") <= 30_000
    assert small.get("a", "c49", STEP) is not None and small.get("a", "c0", STEP) is None
    assert entry_cost("a", "c49", reply(1000)) < 30_000


def test_an_engine_whose_entries_the_pool_evicted_keeps_its_new_one_counted() -> None:
    """The pool's bound can take an engine's last entry while that engine puts a new one:
    the new one is still counted as that engine's."""
    data = reply(200)
    cost = entry_cost("a", "a0", data)  # every id here is as long: every entry costs this
    log = CallLog(per_caller_entries=10, per_caller_bytes=10 * cost, pool_bytes=4 * cost)
    log.put("a", "a0", STEP, data, 0)  # the pool's oldest
    for call_id in ("b0", "b1", "b2"):
        log.put("b", call_id, STEP, data, 0)  # the pool is full
    log.put("a", "a1", STEP, data, 0)  # the pool evicts a0, a's only entry
    assert log.get("a", "a0", STEP) is None and log.get("a", "a1", STEP) is not None
    assert (log.engine_bytes("a"), log.engine_bytes("b"), log.num_bytes) == (
        cost, 3 * cost, 4 * cost,
    )  # fmt: skip
    log.put("a", "a2", STEP, data, 0)  # evicts b0, now the oldest
    assert (log.engine_bytes("a"), log.engine_bytes("b")) == (2 * cost, 2 * cost)


class _ReferenceLog:
    """The log's rule written plainly: one list of entries, oldest first; a put drops the
    same call's entry, then the caller's oldest while it has ``per_caller_entries`` or
    the new one would pass its bytes, then the pool's oldest while the pool's bytes would
    be passed."""

    def __init__(self, per_caller_entries: int, per_caller_bytes: int, pool_bytes: int) -> None:
        self.bounds = (per_caller_entries, per_caller_bytes, pool_bytes)
        self.entries: list[tuple[str, str, int]] = []  # (engine, call id, cost)

    def put(self, engine: str, call_id: str, data: bytes) -> None:
        entries_bound, caller_bytes, pool_bytes = self.bounds
        self.entries = [e for e in self.entries if (e[0], e[1]) != (engine, call_id)]
        cost = entry_cost(engine, call_id, data)
        if cost > caller_bytes or cost > pool_bytes:
            return

        def mine() -> list[tuple[str, str, int]]:
            return [e for e in self.entries if e[0] == engine]

        while mine() and (
            len(mine()) >= entries_bound or sum(e[2] for e in mine()) + cost > caller_bytes
        ):
            self.entries.remove(mine()[0])
        while self.entries and sum(e[2] for e in self.entries) + cost > pool_bytes:
            self.entries.pop(0)
        self.entries.append((engine, call_id, cost))


def test_the_log_keeps_exactly_what_its_rule_says() -> None:
    """Random puts from three engines (repeated ids among them) against the rule written
    plainly: the same entries, in the same order, and the same byte counts after each."""
    rng = random.Random(11)
    bounds = (4, 3_000, 6_000)
    log, reference = CallLog(*bounds), _ReferenceLog(*bounds)
    for _ in range(600):
        engine = rng.choice("abc")
        call_id = f"c{rng.randrange(12)}"
        data = reply(rng.choice([1, 50, 200, 400, 1500]))
        log.put(engine, call_id, STEP, data, 0)
        reference.put(engine, call_id, data)
        assert [(e, c) for e, c, _, _ in log.to_state()] == [
            (e, c) for e, c, _ in reference.entries
        ]
        assert log.num_bytes == sum(cost for _, _, cost in reference.entries)
        for name in "abc":
            assert log.engine_bytes(name) == sum(
                cost for e, _, cost in reference.entries if e == name
            )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("reply-cache")
    tokens = tmp / "engines"
    tokens.write_text(f"engine-a {ENGINE_A}\nengine-b {ENGINE_B}\n")
    agent = tmp / "agent"
    agent.write_text("agent-token-0123456789abc\n")
    with running_server(
        PoolConfig(name="p", max_model_len=256, num_gpu_blocks_override=70_001),
        engine_token_file=str(tokens),
        agent_token_file=str(agent),
        state_dir=str(tmp / "state"),
    ) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=1 << 32, token="agent-token-0123456789abc")
        yield srv
        for rank in ranks:
            rank.close()


def _stub(server: ServerThread) -> tuple[grpc.Channel, kvcache_pb2_grpc.KVCacheServiceStub]:
    channel = grpc.insecure_channel(server.address)
    return channel, kvcache_pb2_grpc.KVCacheServiceStub(channel)


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_read_only_steps_are_not_kept_nor_saved(server: ServerThread) -> None:
    """The attack of issue 32: zero-op Steps, each with a fresh call id and a full page of
    the free queue. None is kept, and the snapshot holds none of them."""
    pool = server.server.pools.by_name["p"]
    before = server.run(lambda: (len(pool.calls), pool.calls.num_bytes))
    channel, stub = _stub(server)
    with channel:
        for i in range(40):
            response = stub.Step(
                kvcache_pb2.StepRequest(pool="p", call_id=f"read-{i}", free_queue_head_limit=65536),
                metadata=_auth(ENGINE_A),
                timeout=10,
            )
            assert len(response.free_queue_head) == 65536
    assert server.run(lambda: (len(pool.calls), pool.calls.num_bytes)) == before
    kept = server.run(
        lambda: [i for i in range(40) if pool.calls.get("engine-a", f"read-{i}", STEP)]
    )
    assert kept == []
    capture = server.call(_capture(server))
    assert not [e for e in capture.server_state["calls"] if e[1].startswith("read-")]


def test_a_step_of_lookups_alone_is_not_kept_and_one_with_an_allocation_is(
    server: ServerThread,
) -> None:
    """A lookup changes nothing: a Step of lookups only (a router's probes, each with a
    call id) is answered and forgotten; the same lookup beside an admission is kept, as
    the admission changed the pool (``changed_the_pool``)."""
    pool = server.server.pools.by_name["p"]
    lookup = kvcache_pb2.STEP_OPERATION_TYPE_LOOKUP
    allocate = kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE
    prompt = list(range(1, 33))
    channel, stub = _stub(server)
    with channel:
        for i in range(3):
            stub.Step(
                kvcache_pb2.StepRequest(
                    pool="p",
                    call_id=f"probe-{i}",
                    types=[lookup, lookup],
                    request_ids=["", ""],
                    num_token_ids=[32, 32],
                    token_ids=prompt + prompt,
                ),
                metadata=_auth(ENGINE_A),
                timeout=10,
            )
        stub.Step(
            kvcache_pb2.StepRequest(
                pool="p",
                call_id="admit-and-probe",
                types=[lookup, allocate],
                request_ids=["", "lookup-beside"],
                num_token_ids=[32, 32],
                num_new_tokens=[0, 32],
                token_ids=prompt + prompt,
                starts={1: kvcache_pb2.RequestStart()},
            ),
            metadata=_auth(ENGINE_A),
            timeout=10,
        )
    kept = server.run(
        lambda: [
            call_id
            for call_id in ("probe-0", "probe-1", "probe-2", "admit-and-probe")
            if pool.calls.get("engine-a", call_id, STEP)
        ]
    )
    assert kept == ["admit-and-probe"]


async def _capture(server: ServerThread) -> SnapshotCapture:
    """What a snapshot of pool p would hold now (taken between two calls)."""
    pool = server.server.pools.by_name["p"]
    async with pool.lock:
        return pool.capture()


def test_changing_steps_are_kept_within_the_callers_bytes(server: ServerThread) -> None:
    """Changing Steps that ask for a full page each (~200 KB replies): engine-a's burst
    stays within its bytes and engine-b's reply is still answered, not applied again."""
    pool = server.server.pools.by_name["p"]
    channel, stub = _stub(server)
    options = ClientOptions(token=ENGINE_B)
    with channel, KVCacheClient(server.address, "p", options=options) as b:
        b_call = kvcache_pb2.StepRequest(pool="p", call_id="b-1")
        b_call.types.append(kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE)
        b_call.request_ids.append("b-req")
        b_call.num_token_ids.append(3)
        b_call.token_ids.extend([9, 9, 9])
        b_call.num_new_tokens.append(3)
        b_call.num_lookahead_tokens.append(0)
        b_call.num_rejected_tokens.append(0)
        b_call.starts[0].SetInParent()
        first = stub.Step(b_call, metadata=_auth(ENGINE_B), timeout=10)
        for i in range(40):
            request = kvcache_pb2.StepRequest(
                pool="p", call_id=f"a-{i}", free_queue_head_limit=65536
            )
            request.types.append(kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE)
            request.request_ids.append(f"a-req-{i}")
            request.num_token_ids.append(1)
            request.token_ids.append(i)
            request.num_new_tokens.append(1)
            request.num_lookahead_tokens.append(0)
            request.num_rejected_tokens.append(0)
            request.starts[0].SetInParent()
            stub.Step(request, metadata=_auth(ENGINE_A), timeout=10)
        a_bytes, b_bytes, total = server.run(
            lambda: (
                pool.calls.engine_bytes("engine-a"),
                pool.calls.engine_bytes("engine-b"),
                pool.calls.num_bytes,
            )
        )
        assert 0 < a_bytes <= CALL_LOG_CALLER_BYTES and b_bytes > 0
        assert total <= CALL_LOG_POOL_BYTES
        # engine-b's retry is answered from its kept reply: applied once.
        assert stub.Step(b_call, metadata=_auth(ENGINE_B), timeout=10) == first
        assert b.block_table("b-req").num_tokens == 3
        capture = server.call(_capture(server))
        saved = sum(len(entry[3]) for entry in capture.server_state["calls"])
        assert saved <= total
        b.free("b-req")
    with KVCacheClient(server.address, "p", options=ClientOptions(token=ENGINE_A)) as a:
        a.free(*[f"a-req-{i}" for i in range(40)])


def test_a_restart_keeps_only_what_was_kept(tmp_path: Path) -> None:
    """The snapshot of a pool that served read-only Steps with call ids holds none of
    them, so a restart from it does not grow (it held 187 MB of such replies)."""
    from tests.server.test_restart import MEMORY, server_on

    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        channel, stub = _stub(srv)
        with channel:
            for i in range(20):
                stub.Step(
                    kvcache_pb2.StepRequest(pool="p", call_id=f"r{i}", free_queue_head_limit=64),
                    timeout=10,
                )
        ranks[0].close()
    with server_on(tmp_path) as srv:
        pool = srv.server.pools.by_name["p"]
        assert srv.run(lambda: len(pool.calls)) == 0
