"""kvsvc's vLLM worker (``KvsvcWorker``) with a real ``kvsvc serve`` and real vLLM engines.

vLLM runs the tiny Llama of :mod:`tests.vllm.helpers` on the CPU with the stock scheduler
and kvsvc's worker only, so these tests see the worker side on its own: registration, the
plan reaching vLLM's sizing, the allocation report, heartbeats, and the errors a user
meets. A stock engine run first gives the references: its block count for the same KV
memory (kvsvc's planner must land on it) and its greedy tokens (the kvsvc-sized engine must
produce the same ones).

The spec conversions (``kvsvc.integrations.vllm.specs``) are tested without an engine at
the end.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as vkv

from kvsvc import specs as ks
from kvsvc.integrations.vllm.specs import (
    UnsupportedSpecError,
    kvsvc_spec_from_vllm,
    kvsvc_specs_from_vllm,
)
from kvsvc.integrations.vllm.worker import KvsvcWorker, KvsvcWorkerError
from kvsvc.models import ModelSpecOptions, layer_specs_for_rank
from tests.tooling import free_port
from tests.vllm.helpers import (
    BLOCK_SIZE,
    KV_CACHE_BYTES,
    POOL,
    TINY_LLAMA_CONFIG,
    KvsvcServer,
    cleanup_after_failed_start,
    driver_worker,
    engine_core,
    greedy_tokens,
    kvsvc_server,
    kvsvc_worker_args,
    make_llm,
    release_llm,
    wait_for,
    write_tiny_model,
)

pytestmark = pytest.mark.e2e

# Two prompts sharing two full blocks (a prefix-cache hit), one short, one spanning blocks.
_BASE = [(7 * i + 3) % 8000 + 10 for i in range(80)]
PROMPTS = [_BASE, [*_BASE[:64], 11, 12, 13], [5, 6, 7, 8], list(range(200, 300))]
MAX_TOKENS = 12
# vLLM's bytes per block for the tiny model: 4 layers x 32 tokens x 2 (K, V) x 2 heads x
# 64 x 4 bytes.
BYTES_PER_BLOCK = 4 * BLOCK_SIZE * 2 * 2 * 64 * 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@dataclass(frozen=True)
class StockRun:
    num_gpu_blocks: int
    tokens: list[list[int]]


@pytest.fixture(scope="module")
def stock(model_dir: Path) -> StockRun:
    """Stock vLLM (no kvsvc) with the same KV memory: the reference block count and tokens."""
    llm = make_llm(model_dir)
    try:
        assert not isinstance(driver_worker(llm), KvsvcWorker)
        return StockRun(
            num_gpu_blocks=engine_core(llm).vllm_config.cache_config.num_gpu_blocks,
            tokens=greedy_tokens(llm, PROMPTS, MAX_TOKENS),
        )
    finally:
        release_llm(llm)


@dataclass
class Served:
    server: KvsvcServer
    llm: Any
    worker: KvsvcWorker


def _heartbeats(worker: KvsvcWorker) -> float:
    agent = worker.kvsvc_agent
    assert agent is not None
    value = agent.metrics.registry.get_sample_value(
        "kvsvc_agent_heartbeats_total", {"pool": POOL, "rank": "0"}
    )
    return value or 0.0


class TestEngineSizedByThePool:
    """One pool (block size 32, memory from the worker) and one vLLM engine sized by it.

    Class-scoped, so the engine is gone before the tests below start theirs: engines of one
    process share vLLM's global distributed state, which an engine's shutdown tears down.
    """

    @pytest.fixture(scope="class")
    def served(self, model_dir: Path, stock: StockRun) -> Iterator[Served]:
        # Takes ``stock`` so the reference engine is released before this one starts.
        with kvsvc_server() as server:
            llm = make_llm(model_dir, **kvsvc_worker_args(server.address))
            try:
                worker = driver_worker(llm)
                assert isinstance(worker, KvsvcWorker)
                yield Served(server, llm, worker)
            finally:
                release_llm(llm)

    def test_pool_is_ready_and_plan_is_what_vllm_allocated(self, served: Served) -> None:
        info = served.server.pool_info()
        assert info.state == "READY", served.server.output()
        assert [(w.rank, w.device, w.allocated) for w in info.workers] == [(0, "cpu", True)]
        assert info.workers[0].kv_cache_bytes == KV_CACHE_BYTES  # vLLM's profiled figure

        plan, response = served.server.plan()
        core_cache = engine_core(served.llm).vllm_config.cache_config
        vllm_config = served.worker.model_runner.kv_cache_config
        assert plan["block_size"] == BLOCK_SIZE == core_cache.block_size
        assert plan["num_blocks"] == response.worker_configs[0].num_blocks
        assert plan["num_blocks"] == core_cache.num_gpu_blocks == vllm_config.num_blocks
        assert info.num_blocks == plan["num_blocks"] - 1  # the null block is not usable
        assert (
            plan["max_model_len"] == engine_core(served.llm).vllm_config.model_config.max_model_len
        )
        # Every layer vLLM allocated is planned, with vLLM's block size.
        assert sorted(plan["groups"][0]["layer_names"]) == sorted(
            name for group in vllm_config.kv_cache_groups for name in group.layer_names
        )

    def test_the_returned_memory_alone_makes_vllm_size_the_plan(self, served: Served) -> None:
        # The override pins the count in this in-process engine; a worker in its own process
        # has only the memory it returns, which must give the same count by vLLM's arithmetic.
        plan = served.worker.kvsvc_plan
        assert plan is not None
        vllm_config = served.worker.model_runner.kv_cache_config
        vllm_bytes_per_block = vllm_config.kv_cache_tensors[0].size // vllm_config.num_blocks
        assert vllm_bytes_per_block == BYTES_PER_BLOCK
        assert served.worker.kvsvc_available_memory is not None
        assert served.worker.kvsvc_available_memory // vllm_bytes_per_block == plan.num_blocks
        assert served.worker.cache_config.num_gpu_blocks_override == plan.num_blocks

    def test_plan_equals_stock_vllm_sizing_for_the_same_memory(
        self, served: Served, stock: StockRun
    ) -> None:
        plan, _ = served.server.plan()
        assert served.worker.kvsvc_profiled_memory == KV_CACHE_BYTES
        assert plan["num_blocks"] == stock.num_gpu_blocks == KV_CACHE_BYTES // BYTES_PER_BLOCK

    def test_registered_specs_are_kvsvcs_own_for_the_model(self, served: Served) -> None:
        # What kvsvc derives from the model's config.json (``kvsvc plan``) is what the worker
        # converted from vLLM's layers.
        converted = kvsvc_specs_from_vllm(served.worker.get_kv_cache_spec())
        derived = layer_specs_for_rank(
            TINY_LLAMA_CONFIG, ModelSpecOptions(block_size=BLOCK_SIZE, dtype="float32"), 0
        )
        assert converted == derived

    def test_generation_matches_stock_vllm(self, served: Served, stock: StockRun) -> None:
        tokens = greedy_tokens(served.llm, PROMPTS, MAX_TOKENS)
        assert tokens == stock.tokens
        assert all(len(t) == MAX_TOKENS for t in tokens)

    def test_worker_heartbeats_while_it_lives(self, served: Served) -> None:
        before = _heartbeats(served.worker)
        wait_for(lambda: _heartbeats(served.worker) > before, 10.0, "a heartbeat")
        info = served.server.pool_info()
        assert info.state == "READY"
        assert info.workers[0].heartbeat_age_seconds < 5.0


# --------------------------------------------------------------------------- override


def test_server_override_sets_vllms_block_count_and_shutdown_ends_the_session(
    model_dir: Path, stock: StockRun
) -> None:
    # vLLM's own profiling decides the offer here (no fixed KV budget); the pool's
    # override decides the count. 40 blocks hold every prompt at once: no preemption, so
    # the tokens are still stock vLLM's.
    with kvsvc_server("--num-gpu-blocks-override", "40") as server:
        llm = make_llm(model_dir, kv_cache_memory_bytes=None, **kvsvc_worker_args(server.address))
        try:
            worker = driver_worker(llm)
            assert isinstance(worker, KvsvcWorker)
            assert worker.model_runner.kv_cache_config.num_blocks == 40
            assert engine_core(llm).vllm_config.cache_config.num_gpu_blocks == 40
            assert worker.kvsvc_profiled_memory is not None
            assert worker.kvsvc_profiled_memory > 40 * BYTES_PER_BLOCK
            plan, _ = server.plan()
            assert plan["num_blocks"] == 40
            assert server.pool_info().state == "READY"
            assert greedy_tokens(llm, PROMPTS, MAX_TOKENS) == stock.tokens
            agent = worker.kvsvc_agent
            assert agent is not None
        finally:
            release_llm(llm)
        # Shutdown stopped the agent's threads; the pool notices the rank is gone.
        assert agent.wait(5.0)
        assert worker.kvsvc_agent is None
        wait_for(lambda: server.pool_info().state != "READY", 10.0, "the pool to lose its rank")


# --------------------------------------------------------------------------- workers apart


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 binds one CPU per worker")
def test_tensor_parallel_workers_in_their_own_processes(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each TP rank runs in a worker process with its own copy of vllm_config, so the
    # override it sets never reaches the engine core: the memory the worker returns alone
    # makes vLLM's sizing land on the plan.
    cpus = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cpus))
    with kvsvc_server(world_size=2) as server:
        llm = make_llm(
            model_dir,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            **kvsvc_worker_args(server.address),
        )
        try:
            info = server.pool_info()
            assert info.state == "READY", server.output()
            assert [(w.rank, w.allocated) for w in info.workers] == [(0, True), (1, True)]
            plan, _ = server.plan()
            # One KV head per rank: half the bytes per block, twice the blocks.
            assert plan["num_blocks"] == 2 * KV_CACHE_BYTES // BYTES_PER_BLOCK
            assert [w["num_blocks"] for w in plan["workers"]] == [plan["num_blocks"]] * 2
            core_cache = engine_core(llm).vllm_config.cache_config
            assert core_cache.num_gpu_blocks_override is None
            assert core_cache.num_gpu_blocks == plan["num_blocks"]
            assert len(greedy_tokens(llm, PROMPTS[2:3], 4)[0]) == 4
        finally:
            release_llm(llm)


# --------------------------------------------------------------------------- errors


def test_block_size_mismatch_is_a_clear_error(model_dir: Path) -> None:
    with kvsvc_server(block_size=32) as server:
        with pytest.raises(KvsvcWorkerError) as raised:
            make_llm(model_dir, block_size=16, **kvsvc_worker_args(server.address, plan_timeout=30))
        cleanup_after_failed_start()
    message = str(raised.value)
    assert server.address in message
    assert "block size 16" in message
    assert "--block-size 32" in message  # what to start vLLM with
    assert "kvsvc serve --block-size 16" in message  # or the pool with


def test_memory_too_small_for_one_request_is_the_planners_error(model_dir: Path) -> None:
    # 1 MiB = 8 blocks = 256 tokens < max_model_len 512: the pool cannot be planned, and
    # the worker says so (with the planner's estimate) instead of waiting for a plan.
    with kvsvc_server() as server:
        with pytest.raises(KvsvcWorkerError) as raised:
            make_llm(
                model_dir,
                kv_cache_memory_bytes=8 * BYTES_PER_BLOCK,
                **kvsvc_worker_args(server.address, plan_timeout=30),
            )
        cleanup_after_failed_start()
    message = str(raised.value)
    assert message.startswith(f"kvsvc: the kvsvc server at {server.address} could not plan")
    assert "max_model_len 512 tokens" in message
    assert "estimated maximum model length" in message


def test_server_not_running_fails_within_the_plan_timeout(model_dir: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(KvsvcWorkerError) as raised:
        make_llm(model_dir, **kvsvc_worker_args(address, plan_timeout=2))
    elapsed = time.monotonic() - started
    cleanup_after_failed_start()
    message = str(raised.value)
    assert message.startswith("kvsvc:")
    assert address in message
    assert re.search(r"could not reach .*plan_timeout=2", message), message
    assert f"kvsvc serve --listen {address} --pool {POOL}" in message
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_missing_settings_fail_at_worker_construction(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="additional_config has no 'kvsvc' entry"):
        make_llm(model_dir, worker_cls=KvsvcWorker.__module__ + ".KvsvcWorker")
    cleanup_after_failed_start()


# --------------------------------------------------------------------------- spec conversion


def _full(**kw: Any) -> vkv.FullAttentionSpec:
    args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 8,
        "head_size": 128,
        "dtype": torch.bfloat16,
    }
    return vkv.FullAttentionSpec(**{**args, **kw})


def test_full_attention_converts_with_its_page_size() -> None:
    spec = kvsvc_spec_from_vllm("l0", _full(head_size_v=64, non_causal=True))
    assert spec == ks.FullAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        head_size_v=64,
        dtype="bfloat16",
        non_causal=True,
    )
    assert spec.page_size_bytes == _full(head_size_v=64).page_size_bytes


def test_full_attention_promoted_from_a_window_keeps_the_window() -> None:
    spec = kvsvc_spec_from_vllm("l0", _full(sliding_window=4096))
    assert isinstance(spec, ks.FullAttentionSpec)
    assert spec.sliding_window == 4096


def test_fp8_kv_cache_converts_its_quant_mode() -> None:
    vllm_spec = _full(dtype=torch.float8_e4m3fn, kv_quant_mode=vkv.KVQuantMode.FP8_PER_TENSOR)
    spec = kvsvc_spec_from_vllm("l0", vllm_spec)
    assert isinstance(spec, ks.FullAttentionSpec)
    assert (spec.dtype, spec.kv_quant_mode) == ("float8_e4m3fn", ks.KVQuantMode.FP8_PER_TENSOR)
    assert spec.page_size_bytes == vllm_spec.page_size_bytes


def test_sliding_window_converts() -> None:
    vllm_spec = vkv.SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=256, dtype=torch.bfloat16, sliding_window=1024
    )
    spec = kvsvc_spec_from_vllm("l1", vllm_spec)
    assert spec == ks.SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=256, dtype="bfloat16", sliding_window=1024
    )
    ctx = ks.SizingContext(max_model_len=8192, max_num_batched_tokens=2048)
    assert spec.max_memory_usage_bytes(ctx) == vllm_spec.page_size_bytes * (
        vllm_spec.max_admission_blocks_per_request(2048, 8192)
    )


def test_mla_converts_including_deepseeks_fp8_rows() -> None:
    plain = vkv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    spec = kvsvc_spec_from_vllm("mla", plain)
    assert isinstance(spec, ks.MLAAttentionSpec)
    assert (spec.head_size, spec.compress_ratio, spec.cache_dtype_str) == (576, 1, None)
    assert spec.page_size_bytes == plain.page_size_bytes == 64 * 576 * 2

    fp8 = vkv.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=vkv.KVQuantMode.FP8_PER_TENSOR,
        state_content_bytes=656,  # what vLLM's MLA layer sets for fp8_ds_mla
    )
    spec = kvsvc_spec_from_vllm("mla", fp8)
    assert isinstance(spec, ks.MLAAttentionSpec)
    assert spec.cache_dtype_str == "fp8_ds_mla"
    assert spec.page_size_bytes == fp8.page_size_bytes == 64 * ks.FP8_DS_MLA_ROW_BYTES_V32


def test_mamba_converts() -> None:
    vllm_spec = vkv.MambaSpec(
        block_size=512, shapes=((3, 1024), (16, 64, 64)), dtypes=(torch.bfloat16, torch.float32)
    )
    spec = kvsvc_spec_from_vllm("mamba", vllm_spec)
    assert spec == ks.MambaSpec(
        block_size=512,
        shapes=((3, 1024), (16, 64, 64)),
        dtypes=("bfloat16", "float32"),
        mamba_type="mamba2",
    )
    assert spec.page_size_bytes == vllm_spec.page_size_bytes


def test_a_kind_kvsvc_does_not_convert_is_named() -> None:
    rswa = vkv.RSWASpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, rswa_window=64
    )
    with pytest.raises(UnsupportedSpecError, match=r"'l3' \(RSWASpec\).*not supported"):
        kvsvc_specs_from_vllm({"l0": _full(), "l3": rswa})


def test_a_field_kvsvc_cannot_represent_is_named() -> None:
    spec = vkv.SlidingWindowSpec(
        block_size=16,
        num_kv_heads=4,
        head_size=64,
        dtype=torch.bfloat16,
        sliding_window=128,
        extra_retained_tokens=2,
    )
    with pytest.raises(UnsupportedSpecError, match="extra_retained_tokens=2"):
        kvsvc_spec_from_vllm("l0", spec)


def test_a_page_layout_kvsvc_sizes_differently_is_refused() -> None:
    packed = _full(num_head_slots=1, state_content_bytes=1000)  # a backend's own packing
    with pytest.raises(UnsupportedSpecError, match=r"vLLM's page is 16000 bytes.*65536 bytes"):
        kvsvc_spec_from_vllm("l0", packed)
