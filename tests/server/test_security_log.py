"""The security log (``kvsvc.security``): refused and returning ranks (takeovers). Pool
state changes and lost streams are operations: the ordinary log (``kvsvc.server``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
import pytest

from kvsvc.server.config import PoolConfig, ServerConfig
from kvsvc.v1 import worker_pb2
from tests.server.harness import (
    FakeRank,
    ServerThread,
    bring_up,
    llama_like_specs,
    running_server,
)


def _lines(caplog: pytest.LogCaptureFixture, logger: str = "kvsvc.security") -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def _wait_for(
    caplog: pytest.LogCaptureFixture,
    text: str,
    timeout: float = 10.0,
    logger: str = "kvsvc.security",
) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in _lines(caplog, logger)):
        assert time.monotonic() < deadline, f"no {logger} line with {text!r}: {caplog.text}"
        time.sleep(0.02)


def test_ready_degraded_lost_back_and_refused_takeovers_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvsvc.security")
    caplog.set_level(logging.INFO, logger="kvsvc.server")
    with running_server(PoolConfig(name="p", world_size=2, max_model_len=256)) as srv:
        ranks = bring_up(srv, "p", world_size=2, kv_cache_bytes=64 * 32 * 1024)
        _wait_for(caplog, "pool p: PLANNED -> READY", logger="kvsvc.server")
        # A second agent for a live rank is refused, and the refusal is logged.
        intruder = FakeRank(srv.address, "p", 1, 2, llama_like_specs(), 64 * 32 * 1024)
        with pytest.raises(grpc.RpcError) as info:
            intruder.register()
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        _wait_for(caplog, "refused a registration of rank 1")
        # Rank 1's agent dies: its stream closes, the pool degrades.
        ranks[1].close()
        _wait_for(caplog, "rank 1 (cpu on test) lost its plan stream", logger="kvsvc.server")
        _wait_for(
            caplog,
            "pool p: READY -> DEGRADED (ranks without a plan stream or heartbeat: [1])",
            logger="kvsvc.server",
        )
        # Its replacement registers: logged as back, its cached blocks forgotten.
        intruder.register()
        _wait_for(caplog, "rank 1 is back")
        intruder.open_stream()
        intruder.wait_for_config()
        intruder.report()
        _wait_for(caplog, "pool p: DEGRADED -> READY", logger="kvsvc.server")
        intruder.close()
        ranks[0].close()
    assert all("session" not in line for line in _lines(caplog))
    # State changes and lost streams are not security events.
    assert not [line for line in _lines(caplog) if " -> " in line or "lost its plan" in line]


def test_a_session_id_must_match_exactly(caplog: pytest.LogCaptureFixture) -> None:
    with running_server(PoolConfig(name="p", max_model_len=256)) as srv:
        (rank,) = bring_up(srv, "p", kv_cache_bytes=64 * 32 * 1024)
        real = rank.session_id
        for forged in ("", real[:-1], real + "0", "é" * len(real)):
            rank.session_id = forged
            assert rank.heartbeat().reregister, forged
        rank.session_id = real
        assert not rank.heartbeat().reregister
        rank.close()


def test_a_report_or_a_plan_stream_needs_the_ranks_session() -> None:
    """ReportAllocation and WatchPlan check the session as Heartbeat does: with a forged
    one (a stale agent's, another agent's guess) they are NOT_FOUND ("register again")
    and change nothing; a report of other tensors would otherwise invalidate the pool."""
    with running_server(PoolConfig(name="p", max_model_len=256)) as srv:
        (rank,) = bring_up(srv, "p", kv_cache_bytes=64 * 32 * 1024, allocation_id="A")

        def pool_view() -> tuple[object, ...]:
            pool = srv.server.pools.by_name["p"]
            return pool.state, pool.num_invalidations, pool.num_allocation_reports

        before = srv.run(pool_view)
        real = rank.session_id
        rank.allocation_id = "other-tensors"
        for forged in ("", real[:-1], real + "0"):
            rank.session_id = forged
            with pytest.raises(grpc.RpcError) as report:
                rank.report()
            assert report.value.code() == grpc.StatusCode.NOT_FOUND, forged
            assert "register again" in (report.value.details() or "")
            stream = rank.stub.WatchPlan(
                worker_pb2.WatchPlanRequest(pool="p", rank=0, session_id=forged), timeout=5
            )
            with pytest.raises(grpc.RpcError) as watch:
                next(stream)
            assert watch.value.code() == grpc.StatusCode.NOT_FOUND, forged
            assert srv.run(pool_view) == before
        rank.session_id = real
        rank.allocation_id = "A-0"
        rank.report()  # the real session is served
        rank.close()


def test_an_orderly_stop_reads_as_one(caplog: pytest.LogCaptureFixture) -> None:
    """Regression (issue 32 item 12): a plain stop logged "lost its plan stream" and
    "READY -> DEGRADED" for every rank, as if the ranks had died."""
    caplog.set_level(logging.INFO, logger="kvsvc.server")
    caplog.set_level(logging.INFO, logger="kvsvc.security")
    config = ServerConfig(
        pools=(PoolConfig(name="p", world_size=2, max_model_len=256),),
        listen="127.0.0.1:0",
        metrics_listen=None,
    )
    srv = ServerThread(config)
    ranks = bring_up(srv, "p", world_size=2, kv_cache_bytes=64 * 32 * 1024)
    _wait_for(caplog, "pool p: PLANNED -> READY", logger="kvsvc.server")
    caplog.clear()
    srv.stop()  # the plan streams are still open: the server ends them
    for rank in ranks:
        rank.close()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("kvsvc")]
    assert not [s for s in said if "lost its plan stream" in s or "DEGRADED" in s], said
    assert not _lines(caplog)


def test_a_rank_back_after_a_restart_with_its_tensors_is_no_security_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (issue 32 item 12): a normal restart (the agent re-registers with the
    tensors it had) logged "rank 0 is back ... with the tensors it had" as a WARNING on
    kvsvc.security. Routine: INFO on kvsvc.server. Fresh tensors after a restart lose the
    rank's KV data: a warning there, still no security event."""
    from tests.server.test_restart import MEMORY, crash, rejoin, server_on

    caplog.set_level(logging.INFO, logger="kvsvc.server")
    caplog.set_level(logging.INFO, logger="kvsvc.security")
    for allocation_id, level, how in (
        ("A-0", logging.INFO, "with the tensors it had"),
        ("B-0", logging.WARNING, "it holds fresh tensors: its KV data is gone"),
    ):
        state = tmp_path / allocation_id
        with server_on(state) as srv:
            (rank,) = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
            rank.close()
            crash(srv)
        caplog.clear()
        with server_on(state) as srv:
            rank = rejoin(srv, allocation_id=allocation_id)
            rank.close()
        back = [r for r in caplog.records if "rank 0 is back" in r.getMessage()]
        assert len(back) == 1, caplog.text
        assert back[0].name == "kvsvc.server" and back[0].levelno == level
        assert how in back[0].getMessage()
        assert not _lines(caplog)
