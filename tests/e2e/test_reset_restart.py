"""A ResetPrefixCache survives a SIGKILL: its journal row is replayed on restart.

A real ``kvsvc serve --state-dir`` caches a prompt, resets its prefix cache, serves more
traffic (admissions, a decode Step, a free) and is killed with SIGKILL; restarted on the
same state directory (its rank back with the same tensors) it must hold the very state it
held before the kill (the pool's snapshot compared whole) and must not find the prompt
that was reset. A restart that skipped the reset row either refuses to start (the rows
after it replay to other replies) or brings the reset blocks back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvsvc_client import ClientOptions, KVCacheClient

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from kvsvc.server.persistence.records import Snapshot
from kvsvc.server.persistence.snapshot_file import read_snapshot
from tests.server.harness import FakeRank, llama_like_specs

pytestmark = pytest.mark.e2e

# 4 layers x 2 heads x (64 + 64) x fp16 x 16 tokens = 32 KiB per block; 40 blocks.
MEMORY = 41 * 4 * 2 * 128 * 2 * 16
QUICK = ClientOptions(timeout=10, retries=3, backoff=0.05, max_backoff=0.2)


def serve(state_dir: Path) -> tuple[Child, str]:
    server = spawn(
        "server",
        [
            "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p",
            "--max-model-len", "256", "--state-dir", str(state_dir), "--log-level", "WARNING",
        ],
    )  # fmt: skip
    port, _ = wait_for_ports(server, timeout=60)
    return server, f"127.0.0.1:{port}"


def join(address: str) -> FakeRank:
    """Rank 0 registers (its tensors: "A-0", the same across the restart) and reports."""
    rank = FakeRank(address, "p", 0, 1, llama_like_specs(), MEMORY, allocation_id="A-0")
    return rank.join()


def pool_snapshot(kv: KVCacheClient, out: Path) -> Snapshot:
    kv.snapshot(out)
    return read_snapshot(out)


@pytest.fixture()
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    try:
        yield started
    finally:
        stop_all(started)


def test_a_reset_before_a_sigkill_stays_reset(tmp_path: Path, children: list[Child]) -> None:
    state_dir = tmp_path / "state"
    old, kept, live = ([base + t for t in range(48)] for base in (1000, 2000, 3000))
    server, address = serve(state_dir)
    children.append(server)
    rank = join(address)
    with KVCacheClient(address, pool="p", options=QUICK) as kv:
        kv.wait_until_ready(timeout=30)
        assert kv.allocate("old", old, len(old), start=True).ok
        assert kv.free("old") > 0
        assert kv.lookup(old) == 32
        assert kv.reset_prefix_cache()
        assert kv.lookup(old) == 0
        # More traffic after the reset: a cached prompt, a live request, a decode Step.
        assert kv.allocate("kept", kept, len(kept), start=True).ok
        assert kv.free("kept") > 0
        assert kv.allocate("live", live, len(live), start=True).ok
        (decoded,) = kv.step().allocate("live", [7], 1).send()
        assert decoded.ok
        before = pool_snapshot(kv, tmp_path / "before.db")
        lookups = [kv.lookup(p) for p in (old, kept, live)]
        assert lookups == [0, 32, 32]
        table = kv.block_table("live")
    rank.close()
    server.process.kill()  # SIGKILL: no final snapshot, the journal as committed
    server.process.wait(10)

    server, address = serve(state_dir)
    children.append(server)
    rank = join(address)
    try:
        with KVCacheClient(address, pool="p", options=QUICK) as kv:
            kv.wait_until_ready(timeout=30)
            after = pool_snapshot(kv, tmp_path / "after.db")
            assert after.state == before.state, "the core state differs from before the kill"
            assert after.server_state == before.server_state
            assert after.identity == before.identity
            assert [kv.lookup(p) for p in (old, kept, live)] == lookups
            assert kv.block_table("live") == table
    finally:
        rank.close()
