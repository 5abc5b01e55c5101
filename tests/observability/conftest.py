"""One live kvsvc for the observability tests: a server on loopback with /metrics, a pool
driven by a known workload, and a real ``kvsvc worker`` process on a second pool.

Pool ``p`` (test ranks, 8 usable blocks of 16 tokens) gets, in order:

1. ``a``: a 32-token shared prefix + 8 tokens, admitted           -> OK, 0 cached
2. ``b``: the same prefix + 8 other tokens, admitted               -> OK, 32 cached
3. Lookup of the prefix + 20 tokens                                -> 32 cached
4. Step [admit ``c`` (100 tokens: 7 blocks, 4 free), free ``b``]  -> NO_SPACE, freed
5. Free ``a`` as preempted
6. ``a`` again, resumed after preemption                           -> OK, 32 cached
7. Free ``a``

so the expected counters are known exactly (see ``Workload``). Pool ``u`` (the same size)
is for tests that hold blocks for a moment and must not disturb ``p``'s figures. Pool
``w`` is planned and allocated by a real agent process (CPU, llama-3.2-1b, 16 MiB) serving
its own /metrics.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvsvc.demo.processes import Child, spawn
from kvsvc.server.config import PoolConfig
from tests.server.harness import FakeRank, ServerThread, bring_up, running_server

BLOCK = 16
# llama_like_specs(): 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB a block.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * BLOCK
USABLE_BLOCKS = 8
PREFIX = list(range(1000, 1032))
_METRICS_LINE = re.compile(r"metrics on http://[^\s:]+:(\d+)/metrics")


@dataclass(frozen=True)
class Workload:
    """What the fixture's workload must show on pool ``p``."""

    allocations_ok: int = 3
    allocations_no_space: int = 1
    hits_new: int = 32
    hits_preempted: int = 32
    queries_preempted: int = 40
    lookups: int = 1
    lookup_hit_tokens: int = 32
    frees_finished: int = 2
    frees_preempted: int = 1
    # Out of the free queue: a's 3, b's 1 (2 shared), a's 1 on resumption (2 were cache
    # hits, which are not allocations). Back to it: b's own 1, then a's 3, twice.
    blocks_allocated: int = 5
    blocks_freed: int = 7
    steps: int = 1
    step_operations: int = 2
    grpc_ok: tuple[tuple[str, int], ...] = (
        ("Allocate", 3),
        ("Step", 1),
        ("Lookup", 1),
        ("Free", 2),
    )


@dataclass
class LiveKvsvc:
    """The running pieces and what was observed while setting them up."""

    server: ServerThread
    metrics_port: int
    fresh_scrape: str  # /metrics before any rank registered or any call
    workload: Workload
    usage: Any  # kvsvc_client.Usage of pool p after the workload
    ranks: list[FakeRank]
    agent: Child | None
    agent_metrics_port: int | None
    agent_skip_reason: str

    def scrape(self) -> str:
        return scrape(self.metrics_port)

    def scrape_agent(self) -> str:
        if self.agent_metrics_port is None:
            pytest.skip(self.agent_skip_reason)
        return scrape(self.agent_metrics_port)

    def heartbeat(self) -> None:
        """Keep the test ranks' heartbeat age small (they do not heartbeat on their own)."""
        for rank in self.ranks:
            rank.heartbeat()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode("utf-8"))


def _run_workload(address: str) -> Any:
    from kvsvc_client import AllocateStatus, KVCacheClient, RequestStart

    with KVCacheClient(address, pool="p") as kv:
        kv.wait_until_ready(timeout=30)
        a = kv.allocate("a", [*PREFIX, *range(1, 9)], 40, start=True)
        assert a.status == AllocateStatus.OK and a.num_cached_tokens == 0
        b = kv.allocate("b", [*PREFIX, *range(11, 19)], 40, start=True)
        assert b.status == AllocateStatus.OK and b.num_cached_tokens == 32
        assert kv.lookup([*PREFIX, *range(21, 41)]) == 32
        step = kv.step()
        step.allocate("c", list(range(2000, 2100)), 100, start=True)
        step.free("b")
        c, _freed = step.send()
        assert c.status == AllocateStatus.NO_SPACE, c
        kv.free("a", preempted=True)
        again = kv.allocate("a", [*PREFIX, *range(1, 9)], 40, start=RequestStart(resumed=True))
        assert again.status == AllocateStatus.OK and again.num_cached_tokens == 32
        kv.free("a")
        return kv.usage()


def _start_agent(address: str) -> tuple[Child | None, int | None, str]:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None, None, "no torch (the worker extra): no worker agent to scrape"
    agent = spawn(
        "worker",
        [
            "worker",
            "--server",
            address,
            "--pool",
            "w",
            "--rank",
            "0",
            "--world-size",
            "1",
            "--device",
            "cpu",
            "--model-config",
            "llama-3.2-1b",
            "--kv-cache-memory",
            "16MiB",
            "--metrics-listen",
            "127.0.0.1:0",
            "--heartbeat-interval",
            "0.5",
        ],
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = _METRICS_LINE.search(agent.output())
        if match:
            return agent, int(match.group(1)), ""
        if not agent.alive():
            break
        time.sleep(0.05)
    output = agent.output()
    agent.stop()
    raise RuntimeError(f"the worker agent did not serve /metrics:\n{output}")


@pytest.fixture(scope="session")
def live() -> Iterator[LiveKvsvc]:
    from kvsvc_client import KVCacheClient

    pools = (
        PoolConfig(name="p", world_size=1, max_model_len=128),
        PoolConfig(name="u", world_size=1, max_model_len=128),
        PoolConfig(name="w", world_size=1, max_model_len=256),
    )
    with running_server(*pools, metrics_listen="127.0.0.1:0", heartbeat_timeout_s=600) as srv:
        metrics_port = srv.server.metrics_port
        fresh = scrape(metrics_port)
        ranks = [
            rank
            for pool in ("p", "u")
            for rank in bring_up(srv, pool, kv_cache_bytes=(USABLE_BLOCKS + 1) * BYTES_PER_BLOCK)
        ]
        agent: Child | None = None
        try:
            usage = _run_workload(srv.address)
            agent, agent_port, reason = _start_agent(srv.address)
            if agent is not None:
                with KVCacheClient(srv.address, pool="w") as kv:
                    kv.wait_until_ready(timeout=60)
                # Ready on the server once the report landed; the agent flips its own
                # gauge right after the reply.
                deadline = time.monotonic() + 10
                while "kvsvc_agent_ready{" not in _ready_lines(agent_port):
                    assert time.monotonic() < deadline, agent.output()
                    time.sleep(0.05)
            yield LiveKvsvc(
                server=srv,
                metrics_port=metrics_port,
                fresh_scrape=fresh,
                workload=Workload(),
                usage=usage,
                ranks=ranks,
                agent=agent,
                agent_metrics_port=agent_port,
                agent_skip_reason=reason,
            )
        finally:
            if agent is not None:
                agent.stop()
            for rank in ranks:
                rank.close()


def _ready_lines(port: int | None) -> str:
    assert port is not None
    return "\n".join(
        line
        for line in scrape(port).splitlines()
        if line.startswith("kvsvc_agent_ready{") and line.endswith(" 1.0")
    )
