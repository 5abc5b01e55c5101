"""The stages the server times in its pool-changing handlers (kvsvc.server.handler_stages):
the collector's families, and a real ``kvsvc serve``'s split of its own calls."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from kvsvc_client import KVCacheClient
from prometheus_client import CollectorRegistry, generate_latest

from kvsvc.demo.processes import spawn, wait_for_ports
from kvsvc.server.handler_stages import METHODS, STAGES, HandlerStageMetrics, HandlerStages
from tests.observability.promtext import parse, value
from tests.server.harness import FakeRank, llama_like_specs


def test_the_collector_exports_every_method_and_stage() -> None:
    stages = HandlerStages()
    stages.table("Step")[STAGES.index("apply")] += 0.25
    stages.table("Free")[STAGES.index("events")] += 0.5
    registry = CollectorRegistry()
    registry.register(HandlerStageMetrics(stages))
    samples = parse(generate_latest(registry).decode())
    family = "kvsvc_handler_stage_seconds_total"
    for method in METHODS:
        for stage in STAGES:
            expected = {("Step", "apply"): 0.25, ("Free", "events"): 0.5}.get((method, stage), 0)
            assert value(samples, family, method=method, stage=stage) == expected


def _split(metrics_port: int) -> dict[str, dict[str, float]]:
    """Per method: each stage's seconds, and the handler's in all (``handler``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        samples = parse(reply.read().decode())
    out: dict[str, dict[str, float]] = {}
    for method in METHODS:
        out[method] = {
            stage: value(samples, "kvsvc_handler_stage_seconds_total", method=method, stage=stage)
            for stage in STAGES
        }
        out[method]["handler"] = value(
            samples, "grpc_server_handling_seconds_sum", grpc_method=method
        )
    return out


def _served_split(extra: list[str]) -> dict[str, dict[str, float]]:
    """A real server (``extra`` flags): 40 framed Allocate/Free pairs, then 40 Steps of 8
    decodes over gRPC; the stage split it exports after them."""
    args = ["serve", "--listen", "127.0.0.1:0", "--frames-listen", "127.0.0.1:0"]
    args += ["--metrics-listen", "127.0.0.1:0", "--pool", "p", "--max-model-len", "4096"]
    args += ["--log-level", "ERROR", *extra]
    child = spawn("server", args)
    try:
        port, metrics_port = wait_for_ports(child)
        address = f"127.0.0.1:{port}"
        frames = next(line.rsplit(" ", 1)[1] for line in child.lines if "kvsvc frames on" in line)
        rank = FakeRank(address, "p", 0, 1, llama_like_specs(), 32 << 20).join()
        try:
            with (
                KVCacheClient(f"frames:{frames}", pool="p") as framed,
                KVCacheClient(address, pool="p") as kv,
            ):
                framed.wait_until_ready(timeout=60)
                for i in range(40):
                    assert framed.allocate(f"r{i}", [i % 1000 + 1] * 32, 32, start=True).ok
                    framed.free(f"r{i}")
                step = kv.step()
                for r in range(8):
                    step.allocate(f"d{r}", [r + 1] * 15, 15, start=True)
                assert all(result.ok for result in step.send())
                for it in range(40):
                    step = kv.step()
                    for r in range(8):
                        step.allocate(f"d{r}", [it + 1], 1)
                    assert all(result.ok for result in step.send())
            return _split(metrics_port)
        finally:
            rank.close()
    finally:
        child.stop()


def test_a_server_splits_its_handlers_time_into_the_stages() -> None:
    split = _served_split([])
    for method in METHODS:
        stages = split[method]
        # Every call decodes, applies and drains its events (a Step's decodes fill blocks:
        # BlockStored events; an Allocate stores its prompt's blocks, a Free none but the
        # drain still runs); and the stages are parts of the handler's time, not more.
        assert stages["decode"] > 0 and stages["apply"] > 0 and stages["events"] > 0, method
        assert sum(stages[stage] for stage in STAGES) <= stages["handler"], (method, stages)
        # The stages are most of it: the rest is the handler's own few calls.
        assert sum(stages[stage] for stage in STAGES) >= 0.3 * stages["handler"], (method, stages)
    # Without a journal a framed reply goes out early (timed as ``reply``); a gRPC one is
    # sent by gRPC after the handler returns, so the gRPC-only Steps have none.
    assert split["Allocate"]["reply"] > 0 and split["Free"]["reply"] > 0
    assert split["Step"]["reply"] == 0


def test_with_a_journal_the_record_is_timed_and_no_reply_goes_early(tmp_path: Path) -> None:
    split = _served_split(["--state-dir", str(tmp_path / "state")])
    for method in METHODS:
        assert split[method]["journal"] > 0, method
        # The reply waits for the commit: none is sent from inside the handler.
        assert split[method]["reply"] == 0, method
        assert sum(split[method][stage] for stage in STAGES) <= split[method]["handler"]
