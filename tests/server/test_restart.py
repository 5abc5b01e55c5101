"""Restarts on a state directory (issue 10), with a real server on loopback.

A server restarted on its state directory serves the pool exactly as before the crash:
the same core state (``to_state`` compared whole), block tables, prefix hits, free count,
event epoch and sequence; engine calls wait (UNAVAILABLE, retried by the client) until
the ranks are back; a rank back with fresh tensors invalidates the pool (its prefix index
is cleared, its live requests answer RECOMPUTE, and an engine that follows the status
finishes them); an operator's forced reset does the same; snapshots replace the journal;
a pool's state moves to another server with ``ctl snapshot`` / ``serve --restore``.

A "crash" here stops the server without its final snapshot (the journal as the last
commit left it); tests/e2e/test_crash_restart.py kills real processes with SIGKILL.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvsvc_client import (
    AllBlocksCleared,
    ClientOptions,
    KVCacheClient,
    NotFoundError,
    UnavailableError,
)

from kvsvc.server.config import PoolConfig, ServerConfig
from kvsvc.server.persistence.records import StateError
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.engine_model import Engine
from tests.server.harness import FakeRank, ServerThread, bring_up, llama_like_specs

# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16
NUM_BLOCKS = 60
MEMORY = (NUM_BLOCKS + 1) * BYTES_PER_BLOCK
POOL = PoolConfig(name="p", world_size=1, max_model_len=256)
QUICK = ClientOptions(timeout=5, backoff=0.01, max_backoff=0.05, unavailable_timeout=0.0)
PATIENT = ClientOptions(timeout=5, backoff=0.01, max_backoff=0.1, unavailable_timeout=30.0)


@contextmanager
def server_on(
    state_dir: Path | None, pool: PoolConfig = POOL, **kwargs: Any
) -> Iterator[ServerThread]:
    restore = kwargs.pop("restore", ())
    config = ServerConfig(
        pools=(pool,),
        listen=kwargs.pop("listen", "127.0.0.1:0"),
        metrics_listen=None,
        state_dir=str(state_dir) if state_dir is not None else None,
        **kwargs,
    )
    srv = ServerThread(config, restore=restore)
    try:
        yield srv
    finally:
        srv.stop()


def crash(srv: ServerThread) -> None:
    """Drop the pools' stores without a final snapshot or checkpoint: on disk is what the
    last commit left (the WAL included), as after a kill."""

    def drop() -> None:
        for pool in srv.server.pools.by_name.values():
            persistence, pool.persistence = pool.persistence, None
            if persistence is not None:
                if persistence._checkpointer is not None:
                    persistence._checkpointer.cancel()
                persistence.store.close()

    srv.run(drop)


def rejoin(
    srv: ServerThread, allocation_id: str = "A-0", specs: Any = None, token: str | None = None
) -> FakeRank:
    """Rank 0 registers again (its tensors' identity: ``allocation_id``) and reports."""
    rank = FakeRank(
        srv.address,
        "p",
        0,
        1,
        specs or llama_like_specs(),
        MEMORY,
        token=token,
        allocation_id=allocation_id,
    )
    return rank.join()


def core_state(srv: ServerThread) -> dict[str, Any]:
    return srv.run(lambda: srv.server.pools.get("p").cache.to_state())  # type: ignore[no-any-return]


def pool_attr(srv: ServerThread, name: str) -> Any:
    return srv.run(lambda: getattr(srv.server.pools.get("p"), name))


def test_a_crashed_server_comes_back_with_every_acknowledged_change(tmp_path: Path) -> None:
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            engine = Engine(kv, seed=7)
            for _ in range(120):
                engine.step()
            engine.check(kv)
            before = core_state(srv)
            epoch, last_seq = kv.epoch, pool_attr(srv, "events").last_sequence
            probes = [engine.prefixes[0] + [5] * 20, list(range(1, 60))]
            hits = [kv.lookup(p) for p in probes]
            assert epoch and last_seq > 0
        for rank in ranks:
            rank.close()
        crash(srv)
    with server_on(tmp_path) as srv:
        assert srv.server.restored and "waiting for its ranks" in srv.server.restored[0]
        assert core_state(srv) == before
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            with pytest.raises(UnavailableError, match="restored"):
                kv.block_table(next(iter(engine.tables)))
            rank = rejoin(srv)
            assert kv.list_pools()[0].state == "READY"
            engine.kv = kv
            engine.check(kv)
            assert [kv.lookup(p) for p in probes] == hits
            assert kv.epoch == epoch
            assert pool_attr(srv, "events").last_sequence == last_seq
            # Subscribers resume without a gap: the next batch is the next number.
            batches: list[Any] = []

            def watch_one() -> None:
                batches.append(next(kv.watch_events(last_seq + 1, epoch=epoch)))

            watch = threading.Thread(target=watch_one, daemon=True)
            watch.start()
            time.sleep(0.3)
            for _ in range(30):
                engine.step()
            watch.join(10)
            assert batches and not batches[0].gap and batches[0].sequence == last_seq + 1
            assert batches[0].epoch == epoch
            engine.check(kv)
            rank.close()


def test_the_client_rides_through_a_restart(tmp_path: Path) -> None:
    """Calls made while the server is down, then restoring, then waiting for its rank,
    are retried until it serves again, and continue on the same state."""
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("a", list(range(1, 41)), 40, start=True).ok
            port = srv.port
        ranks[0].close()
        crash(srv)
    results: list[Any] = []
    with KVCacheClient(f"127.0.0.1:{port}", pool="p", options=PATIENT) as kv:
        caller = threading.Thread(target=lambda: results.append(kv.allocate("a", [7], 1)))
        caller.start()  # the server is down now
        time.sleep(0.3)
        with server_on(tmp_path, listen=f"127.0.0.1:{port}") as srv:
            time.sleep(0.3)  # restored, waiting for its rank
            assert not results
            rank = rejoin(srv)
            caller.join(20)
            assert results and results[0].ok and results[0].num_computed_tokens == 41
            assert kv.block_table("a").num_tokens == 41
            rank.close()


def test_a_retried_step_across_a_restart_is_answered_not_applied_again(tmp_path: Path) -> None:
    step = kvcache_pb2.StepRequest(
        pool="p",
        types=[kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE] * 2,
        request_ids=["a", "b"],
        num_token_ids=[1, 1],
        token_ids=[5, 6],
        num_new_tokens=[1, 1],
        call_id="engine-1:42",
    )
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("a", list(range(1, 17)), 16, start=True).ok
            assert kv.allocate("b", list(range(1, 20)), 19, start=True).ok
            with grpc.insecure_channel(srv.address) as channel:
                first = kvcache_pb2_grpc.KVCacheServiceStub(channel).Step(step, timeout=5)
        ranks[0].close()
        crash(srv)  # as if the reply had been lost in the crash
    with server_on(tmp_path) as srv:
        rank = rejoin(srv)
        with grpc.insecure_channel(srv.address) as channel:
            again = kvcache_pb2_grpc.KVCacheServiceStub(channel).Step(step, timeout=5)
        assert again == first
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert (kv.block_table("a").num_tokens, kv.block_table("b").num_tokens) == (17, 20)
        rank.close()


def test_snapshots_replace_the_journal(tmp_path: Path) -> None:
    settings = {"state_snapshot_every": 60, "state_snapshot_min_interval_s": 0.0}
    with server_on(tmp_path, **settings) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            engine = Engine(kv, seed=3)
            for _ in range(100):
                engine.step()
            persistence = pool_attr(srv, "persistence")
            deadline = time.monotonic() + 20
            while (
                persistence.snapshotting or persistence.work_since_snapshot >= 60
            ) and time.monotonic() < deadline:
                time.sleep(0.05)  # snapshots catch up (one at a time, each in a thread)
            assert persistence.num_snapshots >= 2
            # The journal holds only what came after the last snapshot.
            assert persistence.records_since_snapshot < persistence.last_seq // 2
            before = core_state(srv)
        ranks[0].close()
        crash(srv)
    assert len(list(tmp_path.glob("p.snapshot-*.db"))) == 1  # the old ones were deleted
    with server_on(tmp_path, **settings) as srv:
        assert core_state(srv) == before
        rank = rejoin(srv)
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            engine.kv = kv
            engine.check(kv)
        rank.close()
    # A graceful stop ends with a snapshot: the next start replays nothing.
    with server_on(tmp_path, **settings) as srv:
        assert "0 journal rows replayed" in srv.server.restored[0]


def test_a_rank_back_with_fresh_tensors_invalidates_the_pool(tmp_path: Path) -> None:
    """Its KV data is gone: the prefix index is cleared (an event), no lookup hits what it
    held, live requests answer RECOMPUTE, and an engine that frees and re-admits them
    finishes them all with every block accounted for. A reconnect with the same tensors
    (the same allocation id) changes nothing."""
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            engine = Engine(kv, seed=11)
            for _ in range(40):
                engine.step()
            probe = engine.prefixes[0] + [5] * 20
            assert kv.lookup(probe) > 0
        ranks[0].close()
        crash(srv)
    with server_on(tmp_path) as srv:
        seq = pool_attr(srv, "events").last_sequence
        rank = rejoin(srv, allocation_id="B-new-process")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            batch = next(kv.watch_events(seq + 1, epoch=kv.list_pools()[0].epoch))
            assert batch.sequence == seq + 1 and batch.events == (AllBlocksCleared(),)
            assert kv.lookup(probe) == 0
            assert kv.usage().num_cached_blocks == 0
            assert kv.usage().num_invalidations == 1
            engine.kv = kv
            live = sorted(engine.tables)
            assert live and all(kv.block_table(rid).needs_recompute for rid in live)
            step = kv.step()
            for rid in live:
                step.allocate(rid, [3], 1)
            results = step.send()
            assert results.recompute_indices() == list(range(len(live)))
            assert all(r.needs_recompute for r in results)
            # The engine follows the status: preempt, admit again with its tokens so far.
            for rid in live:
                kv.free(rid, preempted=True)
                assert engine.admit(rid, engine.tokens.pop(rid), resumed=True).ok
            for _ in range(30):
                engine.step()
            engine.check(kv)
            kv.free(*engine.tables)
            usage = kv.usage()
            assert usage.num_free_blocks == usage.num_blocks and usage.num_requests == 0
            # The same tensors again (a reconnect): nothing is invalidated.
            assert kv.allocate("z", probe, len(probe), start=True).ok
            cached = kv.usage().num_cached_blocks
            rank.close()
            time.sleep(0.1)
            again = rejoin(srv, allocation_id="B-new-process")
            assert kv.usage().num_cached_blocks == cached and cached > 0
            assert kv.usage().num_invalidations == 1
            assert kv.allocate("z", [4], 1).ok
            again.close()
        crash(srv)
    with server_on(tmp_path) as srv:
        rejoin(srv, allocation_id="B-new-process").close()
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.usage().num_invalidations == 1  # counted over the pool's life


def test_a_forced_reset_flags_the_live_requests(tmp_path: Path) -> None:
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("a", list(range(1, 41)), 40, start=True).ok
            assert kv.reset_prefix_cache() is False  # refused: blocks are held
            ctl = subprocess.run(
                [sys.executable, "-m", "kvsvc", "ctl", "--server", srv.address,
                 "reset-prefix-cache", "p", "--force"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert ctl.returncode == 0, ctl.stderr
            assert "1 live requests flagged" in ctl.stdout
            assert kv.allocate("a", [1], 1).needs_recompute
            assert kv.lookup(list(range(1, 41))) == 0
            assert kv.usage().num_requests_needing_recompute == 1
            assert kv.usage().num_invalidations == 1
            usage = subprocess.run(
                [sys.executable, "-m", "kvsvc", "ctl", "--server", srv.address, "usage", "p"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            row = re.search(r"^requests +1 \(1 need recompute\)$", usage.stdout, re.M)
            assert row, usage.stdout
            before = core_state(srv)
        ranks[0].close()
        crash(srv)
    with server_on(tmp_path) as srv:  # the invalidation was journaled like any change
        assert core_state(srv) == before


def test_other_specs_after_a_restart_are_refused(tmp_path: Path) -> None:
    with server_on(tmp_path) as srv:
        bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")[0].close()
    with server_on(tmp_path) as srv:
        with pytest.raises(grpc.RpcError) as refused:
            rejoin(srv, specs=llama_like_specs(num_layers=5))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        message = refused.value.details() or ""
        assert "different layer specs" in message and "p.db" in message


def test_changed_plan_settings_are_refused_at_start(tmp_path: Path) -> None:
    with server_on(tmp_path) as srv:
        bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")[0].close()
    other = PoolConfig(name="p", world_size=1, max_model_len=128)
    with pytest.raises(StateError, match=r"max_model_len 256 -> 128"):
        ServerThread(
            ServerConfig(
                pools=(other,), listen="127.0.0.1:0", metrics_listen=None, state_dir=str(tmp_path)
            )
        )


def test_a_pool_moves_to_another_server_with_its_snapshot(tmp_path: Path) -> None:
    first_dir, second_dir, out = tmp_path / "a", tmp_path / "b", tmp_path / "p.snapshot"
    with server_on(first_dir) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            engine = Engine(kv, seed=5)
            for _ in range(50):
                engine.step()
            ctl = subprocess.run(
                [sys.executable, "-m", "kvsvc", "ctl", "--server", srv.address,
                 "snapshot", "p", "--out", str(out)],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert ctl.returncode == 0, ctl.stderr
            assert out.stat().st_mode & 0o777 == 0o600
            before, epoch = core_state(srv), kv.epoch
        ranks[0].close()
    for state_dir in (second_dir, None):  # kept in a state directory there, or in memory
        with server_on(state_dir, restore=[str(out)]) as srv:
            assert core_state(srv) == before
            rank = rejoin(srv)
            with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
                engine.kv = kv
                engine.check(kv)
                assert kv.epoch == epoch
            rank.close()
    with pytest.raises(StateError, match="holds a state of pool 'p' already"):
        ServerThread(
            ServerConfig(
                pools=(POOL,), listen="127.0.0.1:0", metrics_listen=None, state_dir=str(second_dir)
            ),
            restore=[str(out)],
        )


def test_the_clients_say_when_a_restart_lost_the_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A server restarted without its state has another epoch: both clients take it and
    warn that the requests made before are gone; a restart that kept the state is quiet."""
    from kvsvc_client import AsyncKVCacheClient

    with server_on(tmp_path / "kept") as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY)
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("a", list(range(1, 41)), 40, start=True).ok
            kept = kv.epoch
            assert kept
        for rank in ranks:
            rank.close()
    with server_on(None) as srv:  # the same pool, its state not kept: a new epoch
        ranks = bring_up(srv, kv_cache_bytes=MEMORY)
        with caplog.at_level("WARNING", logger="kvsvc_client"):
            with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
                kv.epoch = kept
                kv.usage()
                assert kv.epoch not in (None, kept)
                fresh = kv.epoch
                kv.usage()  # the same epoch again: no second warning

            async def async_client() -> str | None:
                async with AsyncKVCacheClient(srv.address, pool="p") as client:
                    client.epoch = kept
                    await client.usage()
                    return client.epoch

            assert asyncio.run(async_client()) == fresh
        warnings = [r.getMessage() for r in caplog.records if "epoch changed" in r.getMessage()]
        said = (
            f"pool 'p': the server's state epoch changed from {kept} to {fresh}: the requests "
            "this client made before are gone"
        )
        assert warnings == [said, said]  # once by each client
        for rank in ranks:
            rank.close()


def _write_private(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_a_new_engine_frees_what_its_dead_predecessor_left(tmp_path: Path) -> None:
    """An engine that died with requests live, and a new agent process for the rank: the
    engine that starts again frees its namespace's flagged requests in one call (only
    those: another engine's stay), the free is journaled like any other (a restart
    after it serves the same pool), and a Free that lists ids beside the flag is refused
    with nothing changed."""
    agent, engine_a, engine_b = ("agent-token-0123456789", "eng-a-token-0123456789",
                                 "eng-b-token-0123456789")  # fmt: skip
    tokens = {
        "agent_token_file": _write_private(tmp_path / "agent", f"{agent}\n"),
        "engine_token_file": _write_private(
            tmp_path / "engines", f"engine-a {engine_a}\nengine-b {engine_b}\n"
        ),
    }
    state = tmp_path / "state"

    def client(srv: ServerThread, token: str) -> KVCacheClient:
        return KVCacheClient(srv.address, pool="p", options=replace(QUICK, token=token))

    with server_on(state, **tokens) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A", token=agent)
        with client(srv, engine_a) as a, client(srv, engine_b) as b:
            for kv, name in ((a, "a"), (b, "b")):
                for i in range(2):
                    prompt = [i + 1] * 40
                    assert kv.allocate(f"{name}{i}", prompt, 40, start=True).ok
            assert a.free_needing_recompute() == 0  # nothing is flagged yet
            assert a.usage().num_requests == 4
        for rank in ranks:
            rank.close()
        crash(srv)
    with server_on(state, **tokens) as srv:
        rejoin(srv, allocation_id="B-new-process", token=agent)
        with client(srv, engine_a) as a, client(srv, engine_b) as b:
            usage = a.usage()
            assert (usage.num_requests, usage.num_requests_needing_recompute) == (4, 4)
            bad = kvcache_pb2.FreeRequest(pool="p", request_ids=["a0"], needing_recompute=True)
            stub = kvcache_pb2_grpc.KVCacheServiceStub(a._channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Free(bad, metadata=(("authorization", f"Bearer {engine_a}"),), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "needing_recompute" in (info.value.details() or "")
            assert a.usage().num_requests == 4
            assert a.free_needing_recompute() == 2  # engine-a's two, not engine-b's
            with pytest.raises(NotFoundError):
                a.block_table("a0")
            assert b.block_table("b0").needs_recompute
            usage = a.usage()
            assert (usage.num_requests, usage.num_requests_needing_recompute) == (2, 2)
            # The engine starts afresh: a new admission of the same id is served.
            assert a.allocate("a0", [9] * 40, 40, start=True).ok
            before = core_state(srv)
        crash(srv)
    with server_on(state, **tokens) as srv:
        rejoin(srv, allocation_id="B-new-process", token=agent)
        assert core_state(srv) == before


def test_a_model_of_many_layers_comes_back_with_its_plan(tmp_path: Path) -> None:
    """The layers' order is part of the plan: saved under sorted keys, "model.layers.10"
    came before ".2", the plan made again from the saved inputs was another, and every
    restart of a pool of a real model (more than ten layers) was refused."""
    specs = llama_like_specs(num_layers=12)
    memory = (NUM_BLOCKS + 1) * 12 * 2 * 128 * 2 * 16
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=memory, specs=specs, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("a", list(range(1, 41)), 40, start=True).ok
            table = kv.block_table("a")
        plan = srv.run(lambda: srv.server.pools.get("p").plan.to_dict())
        for rank in ranks:
            rank.close()
        crash(srv)
    with server_on(tmp_path) as srv:
        rank = FakeRank(srv.address, "p", 0, 1, specs, memory, allocation_id="A-0")
        rank.register()
        rank.open_stream()
        assert not rank.wait_for_config().error
        rank.report()
        assert srv.run(lambda: srv.server.pools.get("p").plan.to_dict()) == plan
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.block_table("a") == table
        rank.close()
