"""Properties of every plan the planner makes, over random models, layouts and memory.

Whatever the model, a plan must: put every layer in exactly one group; give each rank
tensors that hold exactly its layers and fit its memory; keep one page size per pool where
the layout needs it; give every rank the same block count; and leave room for one
``max_model_len`` request besides the null block. A plan that cannot be made must fail
with a PlanningError, never anything else.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvsvc.errors import PlanningError
from kvsvc.models import get_pp_indices
from kvsvc.planner import (
    AUTO_FIT,
    PlannerOptions,
    allocated_bytes,
    blocks_per_request,
    plan_kv_cache,
    pool_bytes_per_block,
)
from kvsvc.planner.memory import layer_spec, max_memory_usage_bytes
from kvsvc.specs import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

BLOCK = 16


def _template(kind: str, heads: int, window: int) -> KVCacheSpec:
    if kind == "full":
        return FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=64, dtype="bfloat16"
        )
    if kind == "sliding":
        return SlidingWindowSpec(
            block_size=BLOCK,
            num_kv_heads=heads,
            head_size=64,
            dtype="bfloat16",
            sliding_window=window,
        )
    if kind == "mla":
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype="bfloat16")
    # a Mamba state the size of `heads` attention pages
    return MambaSpec(
        block_size=BLOCK,
        shapes=((heads * BLOCK * 2, 64),),
        dtypes=("bfloat16",),
        num_speculative_blocks=heads % 2,
    )


@st.composite
def models(draw: Any) -> dict[str, Any]:
    kinds = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["full", "sliding", "mla", "mamba"]),
                st.sampled_from([1, 2, 4, 8]),
                st.sampled_from([32, 100, 1000]),
            ),
            min_size=1,
            max_size=3,
        )
    )
    templates = [_template(*k) for k in kinds]
    num_layers = draw(st.integers(1, 24))
    layer_kinds = draw(
        st.lists(st.integers(0, len(templates) - 1), min_size=num_layers, max_size=num_layers)
    )
    specs = {f"model.layers.{i}.attn": templates[k] for i, k in enumerate(layer_kinds)}
    pp = draw(st.integers(1, min(3, num_layers)))
    tp = draw(st.sampled_from([1, 2]))
    workers = []
    for rank in range(pp * tp):
        start, end = get_pp_indices(num_layers, rank // tp, pp)
        workers.append({n: s for i, (n, s) in enumerate(specs.items()) if start <= i < end})
    page = 16 * 2 * 64 * 2  # a 1-head bf16 page: the memory unit
    memory = [
        draw(st.integers(0, 4000)) * page if draw(st.booleans()) else 4000 * page
        for _ in range(pp * tp)
    ]
    auto = draw(st.booleans())
    options = PlannerOptions(
        max_model_len=AUTO_FIT if auto else draw(st.integers(1, 4096)),
        derived_max_model_len=4096 if auto else None,
        max_num_batched_tokens=draw(st.sampled_from([16, 256, 2048])),
        num_gpu_blocks_override=draw(st.none() | st.integers(1, 600)),
        disable_hybrid_kv_cache_manager=draw(st.booleans()),
        layout=draw(st.sampled_from(["layer_outer", "block_outer"])),
        tensor_parallel_size=tp,
    )
    return {"specs": specs, "workers": workers, "memory": memory, "options": options}


@settings(deadline=None, max_examples=200)
@given(models())
def test_every_plan_is_consistent(model: dict[str, Any]) -> None:
    specs, workers, memory = model["specs"], model["workers"], model["memory"]
    options: PlannerOptions = model["options"]
    try:
        plan = plan_kv_cache(workers, memory, options)
    except PlanningError as exc:
        event(f"planning error: {str(exc).split(' ')[0]}")
        assert str(exc)
        return
    event("planned")

    # every layer in exactly one group, globally and on each rank
    names = [n for g in plan.global_groups for n in g.layer_names]
    assert sorted(names) == sorted(specs)
    assert [g.layer_names for g in plan.scheduler_config.kv_cache_groups] == [
        g.layer_names for g in plan.global_groups
    ]
    ctx = plan.sizing
    needed = blocks_per_request(plan.scheduler_config.kv_cache_groups, ctx)

    for rank, (config, worker, mem) in enumerate(
        zip(plan.worker_configs, workers, memory, strict=True)
    ):
        assert config.num_blocks == plan.num_blocks
        held = [n for g in config.kv_cache_groups for n in g.layer_names]
        assert sorted(held) == sorted(worker)
        in_tensors = [n for t in config.kv_cache_tensors for n in t.shared_by]
        assert sorted(in_tensors) == sorted(worker), rank
        if not worker:
            assert config.kv_cache_tensors == []
            continue
        bpb = pool_bytes_per_block(config.kv_cache_groups)
        if options.num_gpu_blocks_override is None:
            assert allocated_bytes(config) <= mem
        assert allocated_bytes(config) == bpb * plan.num_blocks
        # the blocks a max_model_len request needs, besides the null block
        assert blocks_per_request(config.kv_cache_groups, ctx) == needed
        assert plan.num_blocks - 1 >= needed
        pages = {
            n: layer_spec(g, n).page_size_bytes
            for g in config.kv_cache_groups
            for n in g.layer_names
        }
        for tensor in config.kv_cache_tensors:
            if options.layout == "layer_outer":
                (page,) = {pages[n] for n in tensor.shared_by}
                assert tensor.size == page * plan.num_blocks
                assert not tensor.is_packed
            else:
                assert tensor.block_stride == bpb
                assert tensor.size == bpb * plan.num_blocks
                assert all(tensor.offset + pages[n] <= bpb for n in tensor.shared_by)

    # one page size per pool: layer-outer groups share slots, so their pages must agree
    if options.layout == "layer_outer" and len(plan.global_groups) > 1:
        all_pages = {
            layer_spec(g, n).page_size_bytes for g in plan.global_groups for n in g.layer_names
        }
        assert len(all_pages) == 1

    if needed:
        assert plan.max_concurrency == plan.num_blocks / needed
    else:
        assert math.isinf(plan.max_concurrency)
    assert plan.block_size % plan.hash_block_size == 0
    for group in plan.global_groups:
        assert plan.block_size % group.kv_cache_spec.block_size == 0

    # auto-fit took the longest length: one token more does not fit some rank
    if options.auto_fit and plan.max_model_len < 4096 and any(workers):
        longer = ctx.with_max_model_len(plan.max_model_len + 1)
        overflows = []
        for config, worker, mem in zip(plan.worker_configs, workers, memory, strict=True):
            if not worker:
                continue
            bpb = pool_bytes_per_block(config.kv_cache_groups)
            pool = options.num_gpu_blocks_override * bpb if options.num_gpu_blocks_override else mem
            overflows.append(max_memory_usage_bytes(config.kv_cache_groups, longer) > pool - bpb)
        assert any(overflows)
