"""Soak: the simulated engine (admissions, chunked prefill, decode Steps, preemptions, frees)
against a real server over gRPC, then every block must be back and the books must agree.

The default run is short; ``KVSVC_SLOW=1`` runs the long one (``-m slow`` selects it).
"""

from __future__ import annotations

import os

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.demo.engine import SimulatedEngine, WorkloadConfig
from kvsvc.server.config import PoolConfig
from tests.server.harness import bring_up, llama_like_specs, running_server

BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16  # llama_like_specs() page bytes x layers


def soak(num_requests: int, blocks: int, seed: int) -> None:
    pool = PoolConfig(name="soak", max_model_len=2048)
    with running_server(pool) as server:
        ranks = bring_up(
            server, "soak", specs=llama_like_specs(), kv_cache_bytes=(blocks + 1) * BYTES_PER_BLOCK
        )
        with KVCacheClient(server.address, pool="soak") as kv:
            workload = WorkloadConfig(
                num_requests=num_requests,
                max_running=24,
                token_budget=1024,
                max_model_len=2048,
                system_prompt_tokens=(100, 300),
                seed=seed,
            )
            stats = SimulatedEngine(kv, workload).run()
            usage = kv.usage()
            assert stats.requests_finished == num_requests
            assert usage.num_requests == 0
            assert usage.num_free_blocks == usage.num_blocks  # every block came back
            assert stats.prompt_tokens == usage.prefix_cache_queries
            assert stats.cached_tokens == usage.prefix_cache_hits
            assert usage.prefix_cache_hits > 0
            assert stats.preemptions > 0  # the pool was small enough to run out
        for rank in ranks:
            rank.close()


def test_soak_short() -> None:
    soak(num_requests=60, blocks=160, seed=1)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVSVC_SLOW"), reason="long soak: set KVSVC_SLOW=1")
def test_soak_long() -> None:
    soak(num_requests=3000, blocks=400, seed=2)
