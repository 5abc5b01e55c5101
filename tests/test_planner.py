"""kvsvc.planner: the cases of vLLM's tests/v1/core/test_kv_cache_utils.py, and ours.

The reference spec for most cases: full attention, 16-token blocks, 2 KV heads of 64,
float32, so one page is 16 * 2 * (64 + 64) * 4 = 16384 bytes (``PAGE``).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from kvsvc.errors import InvalidArgument, PlanningError
from kvsvc.models import (
    ModelSpecOptions,
    bundled_config_path,
    layer_specs_all_ranks,
    load_model_config,
)
from kvsvc.planner import (
    AUTO_FIT,
    KVCachePlan,
    PageSizeUnificationError,
    PlannerOptions,
    allocated_bytes,
    approximate_gcd,
    estimate_max_model_len,
    get_kv_cache_groups,
    is_kv_cache_spec_uniform,
    max_concurrency,
    plan_kv_cache,
    project_groups_to_worker,
    resolve_block_sizes,
    scheduler_kv_cache_config,
    tp_replicas,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_spec_page_size,
)
from kvsvc.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SizingContext,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

PAGE = 16 * 2 * 64 * 4 * 2  # 16384


def full(**kw: Any) -> FullAttentionSpec:
    args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": "float32",
    }
    args.update(kw)
    return FullAttentionSpec(**args)


def sw(**kw: Any) -> SlidingWindowSpec:
    args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": "float32",
        "sliding_window": 1,
    }
    args.update(kw)
    return SlidingWindowSpec(**args)


def chunked(**kw: Any) -> ChunkedLocalAttentionSpec:
    args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": "float32",
        "attention_chunk_size": 4,
    }
    args.update(kw)
    return ChunkedLocalAttentionSpec(**args)


def mamba(**kw: Any) -> MambaSpec:
    # conv (2, 512) + ssm (3, 32, 32), fp32: 4096 + 12288 = 16384 bytes, one PAGE
    args: dict[str, Any] = {
        "block_size": 16,
        "shapes": ((2, 512), (3, 32, 32)),
        "dtypes": ("float32", "float32"),
        "num_speculative_blocks": 2,
    }
    args.update(kw)
    return MambaSpec(**args)


def mla(**kw: Any) -> MLAAttentionSpec:
    args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 576,
        "dtype": "float32",
    }
    args.update(kw)
    return MLAAttentionSpec(**args)


def indexer(**kw: Any) -> MLAAttentionSpec:
    # a sparse-attention indexer cache: 16 * 132 * 1 = 2112 bytes, does not divide MLA's
    return mla(head_size=132, dtype="uint8", **kw)


def swa_mla(**kw: Any) -> SlidingWindowMLASpec:
    args: dict[str, Any] = {
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 576,
        "dtype": "float32",
        "sliding_window": 128,
    }
    args.update(kw)
    return SlidingWindowMLASpec(**args)


def one(specs: dict[str, KVCacheSpec], memory: int, **options: Any) -> KVCacheConfig:
    options.setdefault("max_model_len", 16)
    return plan_kv_cache([specs], [memory], PlannerOptions(**options)).worker_configs[0]


def tensors(*slots: tuple[int, list[str]]) -> list[KVCacheTensor]:
    return [KVCacheTensor(size=size, shared_by=names) for size, names in slots]


# ---- one worker -----------------------------------------------------------------------


def test_one_worker_uniform_spec() -> None:
    config = one({"layer_1": full(), "layer_2": full()}, PAGE * 2 * 32)
    assert config == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=tensors((PAGE * 32, ["layer_1"]), (PAGE * 32, ["layer_2"])),
        kv_cache_groups=[KVCacheGroupSpec(["layer_1", "layer_2"], full())],
    )
    config = one({"layer_1": sw(), "layer_2": sw()}, PAGE * 2 * 32)
    assert config.num_blocks == 32
    assert config.kv_cache_groups == [KVCacheGroupSpec(["layer_1", "layer_2"], sw())]


def test_one_worker_hybrid_disabled_promotes_sliding_window() -> None:
    config = one(
        {"layer_1": full(), "layer_2": sw()}, PAGE * 2 * 32, disable_hybrid_kv_cache_manager=True
    )
    assert config == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=tensors((PAGE * 32, ["layer_1"]), (PAGE * 32, ["layer_2"])),
        kv_cache_groups=[KVCacheGroupSpec(["layer_1", "layer_2"], full(sliding_window=1))],
    )


def test_one_worker_hybrid_groups_share_layer_slots() -> None:
    # one full + one sliding group of one layer each: a block is one page, and both groups
    # alias the same tensor
    config = one({"layer_1": full(), "layer_2": sw()}, PAGE * 2 * 32)
    assert config == KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=tensors((PAGE * 64, ["layer_1", "layer_2"])),
        kv_cache_groups=[
            KVCacheGroupSpec(["layer_1"], full()),
            KVCacheGroupSpec(["layer_2"], sw()),
        ],
    )


def test_one_worker_hybrid_two_layers_per_group() -> None:
    specs: dict[str, KVCacheSpec] = {"layer_1": full(), "layer_2": full()}
    specs.update({f"layer_{i}": sw() for i in range(3, 7)})
    config = one(specs, PAGE * 2 * 32)
    # 2 full + 4 sliding -> groups of 2; sliding layers striped: (3, 5), (4, 6)
    assert config.kv_cache_groups == [
        KVCacheGroupSpec(["layer_1", "layer_2"], full()),
        KVCacheGroupSpec(["layer_3", "layer_5"], sw()),
        KVCacheGroupSpec(["layer_4", "layer_6"], sw()),
    ]
    assert config.num_blocks == 32
    assert config.kv_cache_tensors == tensors(
        (PAGE * 32, ["layer_1", "layer_3", "layer_4"]),
        (PAGE * 32, ["layer_2", "layer_5", "layer_6"]),
    )


def test_one_worker_hybrid_padding_layers() -> None:
    # 3 full + 7 sliding: groups of 3, the sliding layers padded to 9
    specs: dict[str, KVCacheSpec] = {f"layer_{i}": full() for i in range(1, 4)}
    specs.update({f"layer_{i}": sw() for i in range(4, 11)})
    config = one(specs, PAGE * 3 * 32)
    assert [g.layer_names for g in config.kv_cache_groups] == [
        ["layer_1", "layer_2", "layer_3"],
        ["layer_4", "layer_7", "layer_10"],
        ["layer_5", "layer_8"],
        ["layer_6", "layer_9"],
    ]
    assert config.num_blocks == 32
    assert config.kv_cache_tensors == tensors(
        (PAGE * 32, ["layer_1", "layer_4", "layer_5", "layer_6"]),
        (PAGE * 32, ["layer_2", "layer_7", "layer_8", "layer_9"]),
        (PAGE * 32, ["layer_3", "layer_10"]),
    )


def test_one_worker_near_equal_buckets_use_the_larger_group() -> None:
    # 6 full + 5 sliding (gpt-oss + eagle): 6 < 5 * 1.5, so pad to (6 full, 6 sliding)
    specs: dict[str, KVCacheSpec] = {f"layer_{i}": full() for i in range(1, 7)}
    specs.update({f"layer_{i}": sw() for i in range(7, 12)})
    config = one(specs, PAGE * 6 * 32)
    assert [g.layer_names for g in config.kv_cache_groups] == [
        [f"layer_{i}" for i in range(1, 7)],
        [f"layer_{i}" for i in range(7, 12)],
    ]
    assert config.num_blocks == 32
    assert len(config.kv_cache_tensors) == 6
    assert config.kv_cache_tensors[0].shared_by == ["layer_1", "layer_7"]
    assert config.kv_cache_tensors[5].shared_by == ["layer_6"]


def test_one_worker_uniform_type_with_different_pages() -> None:
    specs: dict[str, KVCacheSpec] = {"layer_1": full(head_size=128), "layer_2": full()}
    config = one(specs, PAGE * 3 * 32)
    # a block holds one 2-PAGE and one 1-PAGE layer page: 3 * 32 PAGE -> 32 blocks
    assert config == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=tensors((PAGE * 2 * 32, ["layer_1"]), (PAGE * 32, ["layer_2"])),
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer_1", "layer_2"], UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=specs)
            )
        ],
    )


def test_one_worker_unifies_pages_by_block_size() -> None:
    # sliding head 32 has half the page: its block grows to 32 tokens
    config = one({"layer_1": full(), "layer_2": sw(head_size=32)}, PAGE * 32)
    assert config == KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=tensors((PAGE * 32, ["layer_1", "layer_2"])),
        kv_cache_groups=[
            KVCacheGroupSpec(["layer_1"], full()),
            KVCacheGroupSpec(["layer_2"], sw(head_size=32, block_size=32)),
        ],
    )


def test_one_worker_unifies_pages_by_padding() -> None:
    # head 96 sliding page = 24576 B; 24576 is no multiple of 16384, so the full layer's
    # page is padded: 2 * 32 * 16384 B // 24576 B = 42 blocks
    big = sw(head_size=96)
    config = one({"layer_1": full(), "layer_2": big}, PAGE * 2 * 32)
    padded = big.page_size_bytes
    assert padded == 24576
    assert config == KVCacheConfig(
        num_blocks=42,
        kv_cache_tensors=tensors((padded * 42, ["layer_1", "layer_2"])),
        kv_cache_groups=[
            KVCacheGroupSpec(["layer_1"], full(page_size_padded=padded)),
            KVCacheGroupSpec(["layer_2"], big),
        ],
    )


def test_num_gpu_blocks_override() -> None:
    config = one({"layer_1": full(), "layer_2": full()}, PAGE * 2 * 32, num_gpu_blocks_override=16)
    assert config.num_blocks == 16
    assert config.kv_cache_tensors == tensors((PAGE * 16, ["layer_1"]), (PAGE * 16, ["layer_2"]))


def test_attention_free_model_gets_the_null_block() -> None:
    plan = plan_kv_cache([{}], [0], PlannerOptions(max_model_len=16))
    assert plan.worker_configs == [KVCacheConfig(num_blocks=1)]
    assert plan.num_blocks == 1
    assert math.isinf(plan.max_concurrency)
    assert plan.kv_cache_tokens == 0
    assert plan.to_dict()["max_concurrency"] is None
    assert plan.tp_replicas == 1


# ---- several workers ------------------------------------------------------------------


def test_multiple_workers_same_specs_take_the_smallest_memory() -> None:
    specs = {"layer1": full(), "layer2": full()}
    expected = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=tensors((PAGE * 10, ["layer1"]), (PAGE * 10, ["layer2"])),
        kv_cache_groups=[KVCacheGroupSpec(["layer1", "layer2"], full())],
    )
    for memory in ([PAGE * 2 * 10] * 2, [PAGE * 2 * 10, PAGE * 2 * 20]):
        plan = plan_kv_cache([specs, dict(specs)], memory, PlannerOptions(max_model_len=16))
        assert plan.worker_configs == [expected, expected]


def test_multiple_workers_pp_stages_hold_different_layers() -> None:
    plan = plan_kv_cache(
        [{"layer1": full()}, {"layer2": full(), "layer3": full()}],
        [PAGE * 2 * 10] * 2,
        PlannerOptions(max_model_len=16),
    )
    # stage 0 could hold 20 blocks of one page, stage 1 only 10 of two: both get 10
    assert plan.worker_configs == [
        KVCacheConfig(
            num_blocks=10,
            kv_cache_tensors=tensors((PAGE * 10, ["layer1"])),
            kv_cache_groups=[KVCacheGroupSpec(["layer1"], full())],
        ),
        KVCacheConfig(
            num_blocks=10,
            kv_cache_tensors=tensors((PAGE * 10, ["layer2"]), (PAGE * 10, ["layer3"])),
            kv_cache_groups=[KVCacheGroupSpec(["layer2", "layer3"], full())],
        ),
    ]


def test_multiple_workers_tp_and_pp() -> None:
    stage0 = {"layer1": full(), "layer2": full()}
    stage1 = {"layer3": full()}
    plan = plan_kv_cache(
        [stage0, dict(stage0), stage1, dict(stage1)],
        [PAGE * 2 * 10] * 4,
        PlannerOptions(max_model_len=16, tensor_parallel_size=2),
    )
    assert [c.num_blocks for c in plan.worker_configs] == [10] * 4
    assert plan.worker_configs[0] == plan.worker_configs[1]
    assert plan.worker_configs[2].kv_cache_tensors == tensors((PAGE * 10, ["layer3"]))


def test_multiple_workers_hybrid_pp_keeps_empty_groups() -> None:
    plan = plan_kv_cache(
        [{"layer1": full(), "layer2": full()}, {"layer3": sw(), "layer4": sw()}],
        [PAGE * 2 * 10] * 2,
        PlannerOptions(max_model_len=16),
    )
    # every stage keeps every group (block ids are global), its own empty
    assert plan.worker_configs[0] == KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=tensors((PAGE * 10, ["layer1"]), (PAGE * 10, ["layer2"])),
        kv_cache_groups=[
            KVCacheGroupSpec(["layer1", "layer2"], full()),
            KVCacheGroupSpec([], sw()),
        ],
    )
    assert plan.worker_configs[1].kv_cache_groups == [
        KVCacheGroupSpec([], full()),
        KVCacheGroupSpec(["layer3", "layer4"], sw()),
    ]


def test_multiple_workers_pp_striping_balances_groups() -> None:
    plan = plan_kv_cache(
        [
            {"layer1": full(), "layer2": sw(), "layer3": sw()},
            {"layer4": full(), "layer5": sw(), "layer6": sw()},
        ],
        [PAGE * 10] * 2,
        PlannerOptions(max_model_len=16),
    )
    # groups (1, 4), (2, 5), (3, 6): each stage holds one layer of every group, so a block
    # is one page per stage and nothing is padded
    assert [g.layer_names for g in plan.global_groups] == [
        ["layer1", "layer4"],
        ["layer2", "layer5"],
        ["layer3", "layer6"],
    ]
    assert plan.worker_configs[0].num_blocks == 10
    assert plan.worker_configs[0].kv_cache_tensors == tensors(
        (PAGE * 10, ["layer1", "layer2", "layer3"])
    )
    assert plan.worker_configs[1].kv_cache_tensors == tensors(
        (PAGE * 10, ["layer4", "layer5", "layer6"])
    )


def test_ranks_that_disagree_on_a_layer_are_named() -> None:
    with pytest.raises(
        PlanningError,
        match=r"layer 'layer1' has different KV cache specs on rank 0 and rank 1 "
        r"\(FullAttentionSpec vs SlidingWindowSpec\)",
    ):
        plan_kv_cache(
            [{"layer1": full()}, {"layer1": sw()}],
            [PAGE * 20] * 2,
            PlannerOptions(max_model_len=16),
        )
    with pytest.raises(PlanningError, match=r"on rank 1 and rank 3 \(num_kv_heads 2 vs 4\)"):
        plan_kv_cache(
            [{}, {"a": full()}, {}, {"a": full(num_kv_heads=4)}],
            [PAGE * 20] * 4,
            PlannerOptions(max_model_len=16),
        )


@pytest.mark.parametrize("asymmetric", [False, True])
def test_pp_sharding_sizes_each_stage_by_its_own_layers(asymmetric: bool) -> None:
    # 512 / 16 = 32 blocks for one request, + the null block
    expected_blocks = 512 // 16 + 1
    memory = PAGE * expected_blocks
    plan = plan_kv_cache(
        [{"layer1": full()}, {"layer2": full()}],
        [memory, memory * 2] if asymmetric else [memory] * 2,
        PlannerOptions(max_model_len=512),
    )
    assert [c.num_blocks for c in plan.worker_configs] == [expected_blocks] * 2
    assert plan.worker_configs[1].kv_cache_tensors == tensors((PAGE * 33, ["layer2"]))


def test_project_groups_to_worker() -> None:
    a, b = full(), full(num_kv_heads=4)
    groups = [KVCacheGroupSpec(["layer1", "layer2", "layer3"], a)]
    projected = project_groups_to_worker(groups, {"layer1": a, "layer2": a})
    assert projected == [KVCacheGroupSpec(["layer1", "layer2"], a)]
    assert projected[0].kv_cache_spec is a
    assert project_groups_to_worker(groups, {"layer4": a}) == [KVCacheGroupSpec([], a)]
    uniform = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"layer1": a, "layer2": b, "layer3": a}
    )
    projected = project_groups_to_worker(
        [KVCacheGroupSpec(["layer1", "layer2", "layer3"], uniform)], {"layer1": a, "layer3": a}
    )
    assert projected[0].layer_names == ["layer1", "layer3"]
    spec = projected[0].kv_cache_spec
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    assert list(spec.kv_cache_specs) == ["layer1", "layer3"]


# ---- memory checks, estimates, auto-fit -----------------------------------------------


def test_estimate_max_model_len() -> None:
    # 32 layers, 32 KV heads of 128, fp16: 16 * 32 * 256 * 2 = 256 KiB a page, 8 MiB a block
    # of 16 tokens; 8 GiB hold 1024 blocks = 16384 tokens
    specs = {
        f"layer_{i}": FullAttentionSpec(
            block_size=16, num_kv_heads=32, head_size=128, dtype="float16"
        )
        for i in range(32)
    }
    groups = get_kv_cache_groups(specs)
    ctx = SizingContext(max_model_len=16385, max_num_batched_tokens=32768)
    assert estimate_max_model_len(groups, ctx, 8 * 2**30, upper=16385) == 16384
    assert estimate_max_model_len(groups, ctx, 8 * 2**30, upper=16383) == 16383
    assert estimate_max_model_len(groups, ctx, 1, upper=16383) == 0


def test_memory_error_says_what_is_needed_and_what_fits() -> None:
    # 32 layers of 8 KV heads x 128, bf16: 64 KiB per layer page, 2 MiB per block, so one
    # 131072-token request needs 8192 blocks = 16 GiB. 8 GiB less the null block hold 4095
    # blocks: 65520 tokens.
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(32)}
    with pytest.raises(PlanningError) as info:
        plan_kv_cache([specs], [8 * 2**30], PlannerOptions(max_model_len=131072))
    assert str(info.value) == (
        "To serve at least one request of max_model_len 131072 tokens (--max-model-len), "
        "16.00 GiB of KV cache is needed on rank 0, more than the available KV cache memory "
        "(8.00 GiB, the null block held back). Based on the available memory, the estimated "
        "maximum model length is 65520. Either give the KV cache more memory "
        "(--kv-cache-memory, or --gpu-memory-utilization on a GPU), or lower --max-model-len."
    )
    plan = plan_kv_cache([specs], [8 * 2**30], PlannerOptions(max_model_len=65520))
    assert plan.num_blocks == 4096


def test_no_memory_at_all() -> None:
    with pytest.raises(PlanningError) as info:
        plan_kv_cache([{"a": full()}], [PAGE], PlannerOptions(max_model_len=16))
    assert str(info.value) == (
        "No memory is left for the KV cache blocks on rank 0 (0 B once the null block is "
        "held back): give the KV cache more memory (--kv-cache-memory, or "
        "--gpu-memory-utilization on a GPU)."
    )


def test_memory_error_tells_needed_from_available_when_they_differ_by_one_block() -> None:
    # 16 layers x 32 KiB pages = 512 KiB per block; 4096 tokens need 256 blocks = 128 MiB,
    # and 128 MiB less the null block is 127.5 MiB: at two decimals of a GiB both read 0.12.
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype="bfloat16")
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(16)}
    with pytest.raises(PlanningError) as info:
        plan_kv_cache([specs], [128 * 2**20], PlannerOptions(max_model_len=4096))
    message = str(info.value)
    assert "128.00 MiB of KV cache is needed on rank 0" in message
    assert "available KV cache memory (127.50 MiB, the null block held back)" in message
    assert "the estimated maximum model length is 4080." in message
    assert "vllm.ai" not in message and "gpu_memory_utilization" not in message


@pytest.mark.parametrize("use_override", [True, False])
def test_null_block_is_reserved_in_the_check(use_override: bool) -> None:
    # 512 tokens need 32 blocks; a pool of 32 has only 31 usable after the null block
    spec = full()
    if use_override:
        options = PlannerOptions(max_model_len=512, num_gpu_blocks_override=32)
        memory = PAGE * 1024
    else:
        options = PlannerOptions(max_model_len=512)
        memory = PAGE * 32
    with pytest.raises(PlanningError, match="max_model_len 512 tokens"):
        plan_kv_cache([{"layer1": spec}], [memory], options)
    assert plan_kv_cache([{"layer1": spec}], [PAGE * 33], PlannerOptions(max_model_len=512))


def test_auto_fit() -> None:
    specs = {"layer_1": full(), "layer_2": full()}
    auto = PlannerOptions(max_model_len=AUTO_FIT, derived_max_model_len=1024)
    assert plan_kv_cache([specs], [PAGE * 2 * 1024], auto).max_model_len == 1024
    # 32 blocks of 2 pages, 31 usable: 31 * 16 = 496 tokens
    plan = plan_kv_cache([specs], [PAGE * 2 * 32], auto)
    assert plan.max_model_len == 496
    assert plan.sizing.max_model_len == 496


def test_auto_fit_reserves_the_null_block() -> None:
    auto = PlannerOptions(max_model_len=AUTO_FIT, derived_max_model_len=1024)
    assert plan_kv_cache([{"layer1": full()}], [PAGE * 64], auto).max_model_len == 63 * 16


def test_auto_fit_with_hybrid_mamba() -> None:
    # exactly 1024 tokens: 64 attention blocks + 1 + 2 speculative Mamba blocks + null block
    specs = {"layer_1": mamba(), "layer_2": full()}
    plan = plan_kv_cache(
        [specs],
        [PAGE * (1024 // 16 + 1 + 2 + 1)],
        PlannerOptions(max_model_len=AUTO_FIT, derived_max_model_len=8192),
    )
    assert plan.max_model_len == 1024


def test_auto_fit_respects_num_gpu_blocks_override() -> None:
    specs = {"layer_1": full(), "layer_2": full()}
    plan = plan_kv_cache(
        [specs],
        [PAGE * 2 * 1024],
        PlannerOptions(
            max_model_len=AUTO_FIT, derived_max_model_len=16384, num_gpu_blocks_override=32
        ),
    )
    # 32 blocks, 31 usable
    assert plan.max_model_len == 31 * 16
    assert plan.num_blocks == 32


def test_auto_fit_takes_the_tightest_stage() -> None:
    plan = plan_kv_cache(
        [{"layer1": full()}, {"layer2": full()}],
        [PAGE * 65, PAGE * 33],
        PlannerOptions(max_model_len=AUTO_FIT, derived_max_model_len=4096),
    )
    assert plan.max_model_len == 32 * 16
    assert plan.num_blocks == 33


def test_auto_fit_without_any_room() -> None:
    with pytest.raises(PlanningError, match="Cannot auto-fit max_model_len"):
        plan_kv_cache(
            [{"a": full()}],
            [PAGE],
            PlannerOptions(max_model_len=AUTO_FIT, derived_max_model_len=64),
        )


def test_auto_fit_without_a_model_limit_stops_at_the_cap() -> None:
    # a sliding-window model needs the same memory for any length past its window
    plan = plan_kv_cache(
        [{"a": sw(sliding_window=32)}],
        [PAGE * 1000],
        PlannerOptions(max_model_len=AUTO_FIT, max_num_batched_tokens=16),
    )
    assert plan.max_model_len == 2**31 - 1


# ---- capacity -------------------------------------------------------------------------


def test_max_concurrency() -> None:
    ctx = SizingContext(max_model_len=16384, max_num_batched_tokens=1024)
    fa = FullAttentionSpec(block_size=16, num_kv_heads=32, head_size=128, dtype="float16")
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=32, head_size=128, dtype="float16", sliding_window=1024
    )
    names = [f"layer_{i}" for i in range(32)]
    # full attention: 16384 / 16 = 1024 blocks a request
    assert max_concurrency(KVCacheConfig(1536, [], [KVCacheGroupSpec(names, fa)]), ctx) == 1.5
    # sliding: ceil(min(1023 + 1024, 16384) / 16) + 1 = 129 blocks
    assert max_concurrency(KVCacheConfig(129 * 3, [], [KVCacheGroupSpec(names, swa)]), ctx) == 3
    hybrid = KVCacheConfig(
        (1024 + 129) * 3, [], [KVCacheGroupSpec(names, fa), KVCacheGroupSpec(names, swa)]
    )
    assert max_concurrency(hybrid, ctx) == 3
    # a group of two layers costs as many pool blocks as a group of 32
    unequal = KVCacheConfig(
        1153 * 3, [], [KVCacheGroupSpec(names, fa), KVCacheGroupSpec(["x", "y"], swa)]
    )
    assert max_concurrency(unequal, ctx) == 3
    # the worker shape (uniform-type group) and the scheduler shape agree
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={f"l{i}": fa for i in range(4)})
    worker = KVCacheConfig(
        1153 * 3,
        [],
        [KVCacheGroupSpec(list(uniform.kv_cache_specs), uniform), KVCacheGroupSpec(["x"], swa)],
    )
    scheduler = scheduler_kv_cache_config(1153 * 3, worker.kv_cache_groups)
    assert scheduler.kv_cache_groups[0].kv_cache_spec == fa
    assert max_concurrency(worker, ctx) == max_concurrency(scheduler, ctx) == 3


def test_plan_capacity_figures() -> None:
    plan = plan_kv_cache(
        [{"a": full(), "b": sw(sliding_window=64)}],
        [PAGE * 101],
        PlannerOptions(max_model_len=1024, max_num_batched_tokens=64),
    )
    # full: 64 blocks; sliding: ceil(min(63 + 64, 1024) / 16) + 1 = 9; 101 / 73
    assert plan.num_blocks == 101
    assert plan.max_concurrency == pytest.approx(101 / 73)
    assert plan.kv_cache_tokens == int(101 / 73 * 1024)
    assert plan.block_size == 16 and plan.hash_block_size == 16


# ---- grouping rules -------------------------------------------------------------------


def test_is_kv_cache_spec_uniform() -> None:
    assert is_kv_cache_spec_uniform({"a": full(num_kv_heads=32), "b": full(num_kv_heads=32)})
    assert is_kv_cache_spec_uniform({"a": full(), "b": full(sliding_window=1)})
    assert not is_kv_cache_spec_uniform({"a": full(), "b": sw()})
    assert is_kv_cache_spec_uniform({"a": sw(), "b": sw()})
    assert not is_kv_cache_spec_uniform({"a": sw(sliding_window=1), "b": sw(sliding_window=2)})
    assert is_kv_cache_spec_uniform({})


def test_unify_hybrid_kv_cache_specs() -> None:
    # 1. the sliding layer joins the full layer's block size; its padding scales with it
    specs: dict[str, KVCacheSpec] = {
        "layer_1": full(block_size=64),
        "layer_2": sw(block_size=16, page_size_padded=32 * 1024, sliding_window=1024),
    }
    out = unify_hybrid_kv_cache_specs(specs)
    assert out["layer_1"] == full(block_size=64)
    assert out["layer_2"] == full(block_size=64, page_size_padded=64 * 1024, sliding_window=1024)
    # 2. chunked local attention
    out = unify_hybrid_kv_cache_specs(
        {
            "layer_1": full(),
            "layer_2": chunked(page_size_padded=32 * 1024, attention_chunk_size=512),
        }
    )
    assert out["layer_2"] == full(page_size_padded=32 * 1024, attention_chunk_size=512)
    # 3. both kinds at once
    out = unify_hybrid_kv_cache_specs(
        {
            "layer_1": full(),
            "layer_2": sw(page_size_padded=32 * 1024, sliding_window=1024),
            "layer_3": chunked(page_size_padded=32 * 1024, attention_chunk_size=512),
        }
    )
    assert out["layer_2"] == full(page_size_padded=32 * 1024, sliding_window=1024)
    assert out["layer_3"] == full(page_size_padded=32 * 1024, attention_chunk_size=512)
    # 4. nothing to promote to: an error that says so
    with pytest.raises(PlanningError, match="cannot be allocated as one type"):
        unify_hybrid_kv_cache_specs(
            {"layer_1": sw(sliding_window=1024), "layer_2": chunked(attention_chunk_size=512)}
        )
    with pytest.raises(PlanningError, match=r"\(full_attention, mamba\)"):
        plan_kv_cache(
            [{"a": full(), "m": mamba()}],
            [PAGE * 100],
            PlannerOptions(max_model_len=16, disable_hybrid_kv_cache_manager=True),
        )


def test_unify_page_size_pads_mamba_and_scales_attention() -> None:
    draft = full(num_kv_heads=4)  # 32768
    out = unify_kv_cache_spec_page_size({"m": mamba(), "main": full(), "draft": draft})
    assert out["m"].page_size_bytes == 32768
    assert out["m"].page_size_padded == 32768  # type: ignore[attr-defined]
    assert out["m"].block_size == 16
    assert out["main"].block_size == 32
    assert out["main"].page_size_padded is None  # type: ignore[attr-defined]
    assert out["draft"] is draft
    # an already padded Mamba page is re-padded to the new maximum
    prepadded = mamba(shapes=((2, 256), (3, 32, 32)), page_size_padded=16384)
    assert unify_kv_cache_spec_page_size({"m": prepadded, "d": draft})["m"].page_size_bytes == 32768
    # a Mamba page that does not divide the maximum is padded as well
    odd = mamba(shapes=((6144,),), dtypes=("float32",))
    assert odd.page_size_bytes == 24576
    assert unify_kv_cache_spec_page_size({"m": odd, "d": draft})["m"].page_size_bytes == 32768
    # so is a non-divisible attention page, keeping its block size
    out = unify_kv_cache_spec_page_size({"a": full(block_size=24), "d": draft})
    assert (out["a"].page_size_padded, out["a"].block_size) == (32768, 24)  # type: ignore[attr-defined]
    # uniform pages come back as they are
    same = {"m": mamba(), "a": full()}
    assert unify_kv_cache_spec_page_size(same) is same
    # a padded attention page that divides the maximum scales and re-pads in one step
    padded = sw(page_size_padded=20480)
    out = unify_kv_cache_spec_page_size({"p": padded, "big": full(page_size_padded=40960)})
    assert (out["p"].block_size, out["p"].page_size_bytes) == (32, 40960)


def test_unify_page_size_for_a_narrower_draft_head() -> None:
    # MiMo-like: 192-dim target heads (12288 B page) next to 128-dim draft heads (8192 B)
    target = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=192, dtype="bfloat16")
    draft = sw(num_kv_heads=1, head_size=128, dtype="bfloat16", sliding_window=1024)
    out = unify_kv_cache_spec_page_size({"target_attn": target, "draft_attn": draft})
    assert out["target_attn"] == target
    assert out["draft_attn"].block_size == 16
    assert out["draft_attn"].real_page_size_bytes == 8192
    assert out["draft_attn"].page_size_bytes == 12288


def test_mla_pages_that_cannot_be_unified_need_block_outer() -> None:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(3):
        specs[f"mla.{i}"] = mla()
        specs[f"indexer.{i}"] = indexer()
    specs.update({f"swa.{i}": swa_mla(head_size=1024) for i in range(5)})
    with pytest.raises(PageSizeUnificationError, match="layout='block_outer'"):
        get_kv_cache_groups(specs)
    with pytest.raises(PlanningError, match="kvsvc plan --layout block_outer"):
        plan_kv_cache([specs], [2**30], PlannerOptions(max_model_len=64))


def test_aligned_mla_page_that_misses_the_common_page() -> None:
    # MLA with 4096-byte alignment: 16 * 576 * 2 = 18432 B padded to 20480. Next to a
    # 40960 B Mamba state, doubling its block gives 36864 B (already aligned), not 40960.
    aligned = mla(dtype="bfloat16", alignment=4096)
    big = mamba(shapes=((10240,),), dtypes=("float32",))
    assert (aligned.page_size_bytes, big.page_size_bytes) == (20480, 40960)
    with pytest.raises(
        PageSizeUnificationError, match="gives a 36864-byte page, not the common 40960"
    ):
        get_kv_cache_groups({"m": aligned, "f": big})


def test_packed_groups_keep_spec_compatibility() -> None:
    specs: dict[str, KVCacheSpec] = {}
    for i in range(3):
        specs[f"mla.{i}"] = mla()
        specs[f"indexer.{i}"] = indexer()
    specs.update({f"swa.{i}": swa_mla(head_size=1024) for i in range(5)})
    groups = get_kv_cache_groups(specs, layout="block_outer")
    # the (mla, indexer) pattern repeats 3 times: 3 repeats per group (padding least), so
    # the 5 sliding layers split into 3 + 2
    assert [len(g.layer_names) for g in groups] == [6, 3, 2]
    assert sorted(n for g in groups for n in g.layer_names) == sorted(specs)
    assert groups[1].layer_names == ["swa.0", "swa.2", "swa.4"]

    plan = plan_kv_cache(
        [specs], [196608 * 100], PlannerOptions(max_model_len=64, layout="block_outer")
    )
    config = plan.worker_configs[0]
    # widest group: 3 sliding pages of 16 * 1024 * 4 = 65536 B
    assert config.num_blocks == 100
    offsets = {name: t.offset for t in config.kv_cache_tensors for name in t.shared_by}
    # inside a block: mla 36864 B, indexer 16 * 132 = 2112 B, alternating
    assert [offsets[f"{k}.{i}"] for i in range(3) for k in ("mla", "indexer")] == [
        0,
        36864,
        38976,
        75840,
        77952,
        114816,
    ]
    assert [offsets[f"swa.{i}"] for i in range(5)] == [0, 0, 65536, 65536, 131072]
    assert {t.size for t in config.kv_cache_tensors} == {196608 * 100}
    assert {t.block_stride for t in config.kv_cache_tensors} == {196608}
    assert allocated_bytes(config) == 196608 * 100


def test_block_outer_layout_for_uniform_pages() -> None:
    config = one({"a": full(), "b": full()}, PAGE * 2 * 10, layout="block_outer")
    assert config.kv_cache_tensors == [
        KVCacheTensor(size=PAGE * 2 * 10, shared_by=["a"], offset=0, block_stride=PAGE * 2),
        KVCacheTensor(size=PAGE * 2 * 10, shared_by=["b"], offset=PAGE, block_stride=PAGE * 2),
    ]
    hybrid = one({"a": full(), "b": sw()}, PAGE * 10, layout="block_outer")
    assert hybrid.kv_cache_tensors == [
        KVCacheTensor(size=PAGE * 10, shared_by=["a", "b"], offset=0, block_stride=PAGE)
    ]


def test_mla_draft_with_unifiable_pages_gets_its_own_group() -> None:
    # a 288-dim one-head fp32 sliding draft has MLA's 16 * 576 * 4 B page
    specs = {"target.0.attn": mla(), "draft.0": sw(num_kv_heads=1, head_size=288)}
    groups = get_kv_cache_groups(specs)
    assert len(groups) == 2
    assert not any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups)


def test_mla_with_incompatible_sliding_window_falls_back_to_full_allocation() -> None:
    draft = sw(block_size=16)
    specs = {
        "target.0.attn": mla(block_size=64),
        "target.0.indexer": indexer(block_size=64),
        "draft.0": draft,
    }
    groups = get_kv_cache_groups(specs)
    assert len(groups) == 1
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, UniformTypeKVCacheSpecs) and spec.block_size == 64
    promoted = spec.kv_cache_specs["draft.0"]
    assert type(promoted) is FullAttentionSpec
    assert (promoted.block_size, promoted.sliding_window) == (64, 1)
    assert specs["draft.0"] is draft  # the caller's specs are untouched


def test_hidden_state_layer_gets_an_aligned_group() -> None:
    # full attention, 544-token blocks, 1 head of 512: 544 * 1024 * 2 = 1114112 B, the
    # same as a 557056-element bf16 Mamba state
    full_spec = FullAttentionSpec(block_size=544, num_kv_heads=1, head_size=512, dtype="bfloat16")
    mamba_spec = MambaSpec(
        block_size=544, shapes=((557056,),), dtypes=("bfloat16",), mamba_cache_mode="align"
    )
    hidden = HiddenStateCacheSpec(block_size=544, num_kv_heads=3, head_size=1024, dtype="bfloat16")
    assert full_spec.page_size_bytes == mamba_spec.page_size_bytes == 1114112
    groups = get_kv_cache_groups(
        {"model.full_attn": full_spec, "model.mamba": mamba_spec, "hs.0": hidden}
    )
    group = next(g for g in groups if isinstance(g.kv_cache_spec, HiddenStateCacheSpec))
    # 6144 B per hidden token; 1114112 // 6144 = 181 tokens fit; the largest divisor of the
    # groups' 544-token block that is <= 181 is 136
    assert group.kv_cache_spec.block_size == 136
    assert group.kv_cache_spec.page_size_bytes == 1114112
    assert resolve_block_sizes(groups, PlannerOptions(max_model_len=1024)) == (544, 136)


def test_hidden_state_scales_small_pages() -> None:
    # TP left 1 head of 64 in bf16: a 4096 B page, below one 6 x 512 bf16 hidden token
    kv = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")
    hidden = HiddenStateCacheSpec(block_size=16, num_kv_heads=6, head_size=512, dtype="bfloat16")
    groups = get_kv_cache_groups(
        {"a.0": kv, "w.0": sw(num_kv_heads=1, dtype="bfloat16"), "hs": hidden}
    )
    assert [g.layer_names for g in groups] == [["a.0"], ["w.0"], ["hs"]]
    # scale = ceil(6144 / 4096) = 2: attention blocks of 32 tokens, 8192 B pages
    assert [g.kv_cache_spec.block_size for g in groups[:2]] == [32, 32]
    assert [g.kv_cache_spec.page_size_bytes for g in groups[:2]] == [8192, 8192]
    assert isinstance(groups[1].kv_cache_spec, SlidingWindowSpec)
    hs = next(g for g in groups if "hs" in g.layer_names).kv_cache_spec
    assert (hs.block_size, hs.page_size_bytes) == (1, 8192)


def test_approximate_gcd() -> None:
    assert approximate_gcd([3, 5], lower_bound=3) == 3
    # 1, 2 and 4 all pad nothing: ties go to the larger
    assert approximate_gcd([4, 8, 12]) == 4
    assert approximate_gcd([7], lower_bound=9) == 9
    with pytest.raises(ValueError, match="positive"):
        approximate_gcd([0, 3])


# ---- block sizes and replicas ---------------------------------------------------------


def test_block_sizes() -> None:
    opts = PlannerOptions(max_model_len=1024)
    single = [KVCacheGroupSpec(["a"], full())]
    assert resolve_block_sizes(single, opts) == (16, 16)
    with pytest.raises(PlanningError, match=r"prefix_match_unit=32.*set it to 16"):
        resolve_block_sizes(single, replace(opts, prefix_match_unit=32))
    assert resolve_block_sizes(
        single, replace(opts, prefix_match_unit=32, enable_prefix_caching=False)
    ) == (16, 16)
    # DCP 4: a block-table entry spans 16 * 4 tokens
    assert resolve_block_sizes(single, replace(opts, dcp_world_size=4)) == (64, 64)

    two = [KVCacheGroupSpec(["a"], full()), KVCacheGroupSpec(["b"], sw(block_size=32))]
    assert resolve_block_sizes(two, opts) == (32, 16)
    assert resolve_block_sizes(two, replace(opts, prefix_match_unit=8)) == (32, 8)
    with pytest.raises(PlanningError, match="must be divisible by it; group block sizes are"):
        resolve_block_sizes(two, replace(opts, prefix_match_unit=12))
    assert resolve_block_sizes(two, replace(opts, enable_prefix_caching=False)) == (32, 32)

    # Mamba outside "align" keeps no per-block state: hash at the scheduler size
    with_mamba = [KVCacheGroupSpec(["a"], full()), KVCacheGroupSpec(["m"], mamba(block_size=48))]
    assert resolve_block_sizes(with_mamba, opts) == (48, 48)
    aligned = [
        KVCacheGroupSpec(["a"], full()),
        KVCacheGroupSpec(["m"], mamba(block_size=48, mamba_cache_mode="align")),
    ]
    assert resolve_block_sizes(aligned, opts) == (48, 16)
    # cross-attention is never prefix-cached: it does not constrain the hash size
    cross = CrossAttentionSpec(block_size=48, num_kv_heads=2, head_size=64, dtype="float32")
    assert resolve_block_sizes(
        [KVCacheGroupSpec(["a"], full(block_size=32)), KVCacheGroupSpec(["c"], cross)], opts
    ) == (96, 32)
    assert resolve_block_sizes([], opts) == (16, 16)


def test_tp_replicas() -> None:
    groups = [KVCacheGroupSpec(["a"], mla())]
    assert tp_replicas(groups, PlannerOptions(max_model_len=16, tensor_parallel_size=8)) == 8
    assert (
        tp_replicas(
            groups, PlannerOptions(max_model_len=16, tensor_parallel_size=8, dcp_world_size=2)
        )
        == 1
    )
    attn = [KVCacheGroupSpec(["a"], full(num_kv_heads=1))]
    # 8 KV heads over 16 ranks: each head is on 2 consecutive ranks
    hinted = PlannerOptions(max_model_len=16, tensor_parallel_size=16, total_num_kv_heads=8)
    assert tp_replicas(attn, hinted) == 2
    assert tp_replicas(attn, replace(hinted, total_num_kv_heads=None)) == 1
    assert tp_replicas([*attn, KVCacheGroupSpec(["m"], mamba())], hinted) == 1
    assert tp_replicas([], hinted) == 1


# ---- inputs and options ---------------------------------------------------------------


def test_inputs_are_validated() -> None:
    opts = PlannerOptions(max_model_len=16)
    with pytest.raises(InvalidArgument, match="available_memory: has 1 entries for 2 ranks"):
        plan_kv_cache([{}, {}], [1], opts)
    with pytest.raises(InvalidArgument, match="at least one rank"):
        plan_kv_cache([], [], opts)
    with pytest.raises(
        InvalidArgument, match="tensor_parallel_size: 2 does not divide the 3 ranks"
    ):
        plan_kv_cache([{}, {}, {}], [1, 1, 1], replace(opts, tensor_parallel_size=2))
    with pytest.raises(InvalidArgument, match=r"worker_specs\[0\]\['a'\]: not a KV cache spec"):
        plan_kv_cache([{"a": 3}], [1], opts)  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument, match="max_model_len"):
        PlannerOptions(max_model_len=0)
    with pytest.raises(InvalidArgument, match="layout: unknown layout 'rows'"):
        PlannerOptions(max_model_len=16, layout="rows")
    with pytest.raises(InvalidArgument, match="num_gpu_blocks_override"):
        PlannerOptions(max_model_len=16, num_gpu_blocks_override=0)
    with pytest.raises(PlanningError, match="decode context parallelism does not support"):
        plan_kv_cache([{"a": sw()}], [PAGE * 100], replace(opts, dcp_world_size=2))


# ---- whole models ---------------------------------------------------------------------


def model_plan(name: str, memory: int, **kw: Any) -> KVCachePlan:
    config = load_model_config(bundled_config_path(name))
    tp, pp = kw.pop("tp", 1), kw.pop("pp", 1)
    specs = layer_specs_all_ranks(config, ModelSpecOptions(tp=tp, pp=pp))
    return plan_kv_cache(
        specs, [memory] * len(specs), PlannerOptions(tensor_parallel_size=tp, **kw)
    )


def test_jamba_plan() -> None:
    plan = model_plan("jamba-v0.1", 30 * 2**30, max_model_len=262144)
    # 28 Mamba layers in 7 groups of 4 (the 4 attention layers set the group size)
    assert [g.kv_cache_spec.kind for g in plan.global_groups].count("mamba") == 7
    # a block: 4 layers of 80 tokens * 4096 B = 1.25 MiB; 30 GiB / 1.25 MiB = 24576
    assert plan.num_blocks == 24576
    # a request: ceil(262144 / 80) = 3277 attention blocks + one state block per Mamba group
    assert plan.max_concurrency == pytest.approx(24576 / (3277 + 7))


def test_deepseek_plan_with_pp_and_tp() -> None:
    plan = model_plan("deepseek-v3", 40 * 2**30, max_model_len=163840, tp=8, pp=2)
    # 61 layers over 2 stages: [31, 30]; stage 0 sets the block count:
    # 40 GiB / (31 * 18432 B) = 75063 blocks
    assert [len(c.kv_cache_tensors) for c in plan.worker_configs] == [31] * 8 + [30] * 8
    assert plan.num_blocks == 40 * 2**30 // (31 * 18432)
    assert plan.tp_replicas == 8
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["num_blocks"] == plan.num_blocks
    assert {w["num_blocks"] for w in data["workers"]} == {plan.num_blocks}
    assert data["groups"][0]["kind"] == "mla_attention"


def test_gemma3_plan_groups() -> None:
    plan = model_plan(
        "gemma-3-12b", 20 * 2**30, max_model_len=AUTO_FIT, derived_max_model_len=131072, pp=2
    )
    # 8 global + 40 sliding layers: 1 full and 5 sliding groups of 8
    kinds = [str(g.kv_cache_spec.kind) for g in plan.global_groups]
    assert sorted(kinds) == ["full_attention"] + ["sliding_window"] * 5
    assert all(len(g.layer_names) == 8 for g in plan.global_groups)
    # striping: each of the 2 stages holds 4 layers of every group
    assert all(len(g.layer_names) == 4 for g in plan.worker_configs[0].kv_cache_groups)
    assert plan.max_model_len == 131072


def test_to_dict_shape() -> None:
    plan = plan_kv_cache(
        [{"a": full(), "b": sw()}, {"c": full(), "d": sw()}],
        [PAGE * 40, PAGE * 40],
        PlannerOptions(max_model_len=64),
    )
    data = json.loads(json.dumps(plan.to_dict()))
    for key in (
        "num_blocks",
        "block_size",
        "hash_block_size",
        "max_model_len",
        "kv_cache_tokens",
        "max_concurrency",
        "tp_replicas",
        "layout",
        "sizing",
        "groups",
        "workers",
    ):
        assert key in data
    assert data["groups"][0] == {
        "index": 0,
        "kind": "full_attention",
        "block_size": 16,
        "page_size_bytes": PAGE,
        "num_layers": 2,
        "sliding_window": None,
        "blocks_per_request": 4,
        "layer_names": ["a", "c"],
        "spec": data["groups"][0]["spec"],
    }
    worker = data["workers"][1]
    assert worker["tensors"] == [
        {
            "size": PAGE * 40,
            "layers": ["c", "d"],
            "offset": 0,
            "block_stride": 0,
            "page_stride": PAGE,
        }
    ]
    assert worker["allocated_bytes"] == PAGE * 40
    assert worker["available_memory"] == PAGE * 40
    assert data["sizing"]["max_model_len"] == 64
