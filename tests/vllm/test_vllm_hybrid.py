"""Hybrid and local-attention models on kvsvc against stock vLLM, real processes.

vLLM's hybrid allocator gives these models several KV cache groups of different kinds:
Gemma 3 a sliding-window and a full-attention group, a Mistral-style model one
sliding-window group, Llama 4 chunked-local-attention groups beside a full-attention one.
Each runs the dense test's workload (shared prefixes, repeats, a KV cache small enough that
requests are preempted and out-of-window blocks are dropped and evicted) through stock
vLLM and through vLLM on kvsvc: the same tokens, per-request cached tokens, prefix-cache
counters and preemptions, and every block back in the pool at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from test_vllm_on_kvsvc import Run, generate

from kvsvc.integrations.vllm import vllm_kwargs
from tests.vllm.helpers import KvsvcServer, engine_core, kvsvc_server, make_llm, release_llm
from tests.vllm.models import write_model

pytestmark = pytest.mark.e2e

# Blocks (null block included) per model: small enough that the workload preempts.
NUM_BLOCKS = {"gemma3": 40, "mistral": 24, "llama4": 128}


@dataclass
class Pair:
    name: str
    stock: Run
    on_kvsvc: Run
    server: KvsvcServer
    llm: Any
    groups: list[str]


@pytest.fixture(scope="module", params=sorted(NUM_BLOCKS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """Stock vLLM, then vLLM on kvsvc (over the framed transport), for one model."""
    name = request.param
    model_dir = write_model(name, tmp_path_factory.mktemp(name))
    num_blocks = NUM_BLOCKS[name]
    llm = make_llm(model_dir, num_gpu_blocks_override=num_blocks, disable_log_stats=False)
    try:
        groups = [
            type(g.kv_cache_spec).__name__
            for g in engine_core(llm).scheduler.kv_cache_config.kv_cache_groups
        ]
        stock = generate(llm)
    finally:
        release_llm(llm)
    with kvsvc_server(
        "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", "512", frames=True
    ) as server:
        kwargs = vllm_kwargs(server.address, "vllm", frames=server.frames)
        llm = make_llm(model_dir, disable_log_stats=False, **kwargs)
        try:
            yield Pair(name, stock, generate(llm), server, llm, groups)
        finally:
            release_llm(llm)


def test_the_model_has_the_groups_it_is_here_for(pair: Pair) -> None:
    assert set(pair.groups) & {"SlidingWindowSpec", "ChunkedLocalAttentionSpec"}, pair.groups


def test_the_workload_preempts_and_hits(pair: Pair) -> None:
    assert pair.stock.metrics["vllm:num_preemptions"] > 0
    assert pair.stock.metrics["vllm:prefix_cache_hits"] > 0


def test_same_tokens_hits_and_preemptions_as_stock_vllm(pair: Pair) -> None:
    assert pair.on_kvsvc.tokens == pair.stock.tokens
    assert pair.on_kvsvc.cached == pair.stock.cached
    assert pair.on_kvsvc.metrics == pair.stock.metrics


def test_every_block_is_back_and_one_rpc_per_step(pair: Pair) -> None:
    with pair.server.client() as client:
        usage = client.usage()
    assert usage.num_requests == 0
    assert usage.num_free_blocks == usage.num_blocks == NUM_BLOCKS[pair.name] - 1
    stats = engine_core(pair.llm).scheduler.kvsvc.stats
    assert max(stats.rpcs_by_step) == 1 and stats.resyncs == 0
