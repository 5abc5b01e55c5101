"""Crashes with real processes (issue 10): `kvsvc serve --state-dir` killed with SIGKILL
under load, several times, and a worker agent replaced by a fresh one.

An engine (this process) drives the pool (admissions with shared prefixes, decode Steps,
preemptions, frees) through the typed client, which retries through each outage, and
records every reply it got. The server is killed at random points, both while calls are
in flight and between them; after each restart on the same state directory (same port)
every acknowledged live request's block table and computed-token count are as
acknowledged, the free count adds up, the prefix index hits the same blocks (probed
before a kill between calls), and a subscriber that follows the events across every
restart sees one unbroken sequence (no gap, no number twice). The `kvsvc worker` agent
keeps its tensors throughout, so nothing is invalidated; then it is killed and a new agent
process takes the rank: the pool's index is cleared, the engine's live requests answer
RECOMPUTE, and the engine, following the status, finishes every request with every block
back.

Seeded; the default run is short, ``KVSVC_SLOW=1`` kills more often and runs longer.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvsvc_client import AllBlocksCleared, ClientOptions, KVCacheClient, KVCacheError

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from tests.server.engine_model import Engine

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

SLOW = bool(os.environ.get("KVSVC_SLOW"))
KILLS = 12 if SLOW else 4
RUN_S = (0.5, 3.0) if SLOW else (0.3, 1.2)
# One full-attention layer, 1 KV head of 64, fp16, 16-token blocks: 4 KiB per block.
SPECS = {
    "model.layers.0.self_attn.attn": {
        "type": "full_attention",
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": "float16",
    }
}
# The engine keeps retrying while the server is down, restarting or waiting for its rank.
PATIENT = ClientOptions(timeout=10, backoff=0.02, max_backoff=0.3, unavailable_timeout=90)
QUICK = ClientOptions(timeout=10, retries=5, backoff=0.05, max_backoff=0.5)


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.state_dir = tmp / "state"
        self.spec_file = tmp / "specs.json"
        self.spec_file.write_text(json.dumps(SPECS))
        self.port = 0
        self.server: Child | None = None
        self.worker: Child | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_server(self) -> None:
        self.server = spawn(
            "server",
            [
                "serve", "--listen", f"127.0.0.1:{self.port}", "--metrics-listen", "off",
                "--pool", "crash", "--max-model-len", "512", "--heartbeat-timeout", "3",
                "--state-dir", str(self.state_dir), "--log-level", "WARNING",
            ],
        )  # fmt: skip
        self.port, _ = wait_for_ports(self.server, timeout=60)

    def start_worker(self, name: str = "worker") -> None:
        self.worker = spawn(
            name,
            [
                "worker", "--server", self.address, "--pool", "crash", "--rank", "0",
                "--world-size", "1", "--device", "cpu", "--spec-file", str(self.spec_file),
                "--kv-cache-memory", "1MiB", "--heartbeat-interval", "0.3",
            ],
        )  # fmt: skip

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.process.kill()  # SIGKILL: no final snapshot, no checkpoint
        self.server.process.wait(10)

    def children(self) -> list[Child]:
        return [c for c in (self.server, self.worker) if c is not None]


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_server()
        cluster.start_worker()
        with KVCacheClient(cluster.address, pool="crash", options=QUICK) as kv:
            kv.wait_until_ready(timeout=120)
        yield cluster
    finally:
        stop_all(cluster.children())


class Driver:
    """Runs the engine in a thread; ``pause()`` returns once no call is in flight."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.running = threading.Event()
        self.idle = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.running.set()
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.running.is_set():
                    self.idle.set()
                    self.running.wait(0.1)
                    continue
                self.idle.clear()
                self.engine.step()
                self.steps += 1
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.idle.set()

    def pause(self) -> None:
        self.running.clear()
        assert self.idle.wait(120), "the engine did not come to rest"
        if self.error is not None:
            raise self.error

    def resume(self) -> None:
        self.running.set()


class Follower:
    """Follows the pool's events across restarts (the client reconnects and resumes with
    its epoch and next sequence number); keeps every batch it got."""

    def __init__(self, address: str) -> None:
        self.batches: list[Any] = []
        self.kv = KVCacheClient(address, pool="crash", options=QUICK)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.kv.watch_events(1):
                self.batches.append(batch)
        except KVCacheError:
            pass  # closed at the end

    def close(self) -> None:
        self.kv.close()
        self.thread.join(10)


def hits(kv: KVCacheClient, prompts: list[list[int]]) -> list[Any]:
    """The blocks an admission of each prompt would start with, now."""
    step = kv.step()
    for prompt in prompts:
        step.lookup(prompt)
    return [(r.num_cached_tokens, r.block_ids) for r in step.send()]


def wait_ready(kv: KVCacheClient) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if kv.list_pools()[0].state == "READY":
                return
        except KVCacheError:
            pass
        time.sleep(0.1)
    raise AssertionError("the pool did not come back READY")


def test_sigkill_under_load_loses_no_acknowledged_change(cluster: Cluster) -> None:
    rng = random.Random(20261201)
    follower = Follower(cluster.address)
    with (
        KVCacheClient(cluster.address, pool="crash", options=PATIENT) as kv,
        KVCacheClient(cluster.address, pool="crash", options=QUICK) as checker,
    ):
        engine = Engine(kv, seed=42)
        probes = [prefix + [9] * 20 for prefix in engine.prefixes]
        driver = Driver(engine)
        epoch = None
        for kill in range(KILLS):
            time.sleep(rng.uniform(*RUN_S))
            between_calls = kill % 2 == 1
            if between_calls:
                driver.pause()
                before = hits(checker, probes)
            cluster.kill_server()
            cluster.start_server()
            wait_ready(checker)  # the agent re-registered with its tensors
            driver.pause()  # the engine's retried call (if any) went through
            engine.check(checker)
            if between_calls:
                assert hits(checker, probes) == before
            info = checker.list_pools()[0]
            assert info.persistent and (epoch is None or info.epoch == epoch)
            epoch = info.epoch
            driver.resume()
        time.sleep(0.5)
        driver.pause()
        assert driver.steps > 20 and engine.recomputed == 0
        assert kv.epoch == epoch

        # A new agent process takes the rank: its memory is fresh.
        assert cluster.worker is not None
        cluster.worker.process.kill()
        cluster.worker.process.wait(10)
        cluster.start_worker("worker-new")
        wait_ready(checker)
        assert checker.usage().num_cached_blocks == 0
        stale = set(engine.tables)  # their KV data went with the old agent's tensors
        engine.released.clear()
        driver.resume()
        deadline = time.monotonic() + 60
        while not stale <= engine.released and time.monotonic() < deadline:
            time.sleep(0.1)
        driver.pause()
        # Each got RECOMPUTE and was re-admitted, or was freed by the engine before its
        # next allocation (a free of a flagged request needs no recompute).
        assert stale and stale <= engine.released and engine.recomputed > 0
        engine.check(checker)
        driver.stop.set()
        driver.resume()
        driver.thread.join(30)
        kv.free(*engine.tables)
        usage = checker.usage()
        assert usage.num_requests == 0 and usage.num_free_blocks == usage.num_blocks
    follower.close()
    sequences = [b.sequence for b in follower.batches]
    assert not any(b.gap for b in follower.batches)
    assert sequences == list(range(1, len(sequences) + 1))  # unbroken across the restarts
    assert any(isinstance(e, AllBlocksCleared) for b in follower.batches for e in b.events)
