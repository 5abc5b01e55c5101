"""``plan_kv_cache``: from every rank's layer specs and memory to every rank's KV cache config.

The steps (vLLM's ``get_kv_cache_configs``):

1. merge the ranks' specs into the whole model's (ranks of one stage must agree);
2. group the layers (:mod:`kvsvc.planner.grouping`), on the whole model so every stage
   uses the same groups;
3. project the groups onto each rank's layers;
4. with ``num_gpu_blocks_override``, size against that many blocks instead of the memory;
5. hold back one block (the null block) and, with ``max_model_len=-1``, find the longest
   request every rank can hold; then check that one request of ``max_model_len`` fits;
6. build each rank's tensors, and give every rank the smallest rank's block count (one
   scheduler hands out the same block ids to all of them);
7. derive the scheduler's view, its block sizes, the capacity and the TP replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import partial, reduce
from typing import Any

from kvsvc.errors import InvalidArgument, PlanningError
from kvsvc.planner.grouping import get_kv_cache_groups
from kvsvc.planner.layout import (
    allocated_bytes,
    kv_cache_config_from_groups,
    page_stride,
    project_groups_to_worker,
)
from kvsvc.planner.memory import (
    MORE_MEMORY_HINT,
    blocks_per_request,
    check_enough_memory,
    estimate_max_model_len,
    group_blocks_per_request,
    max_memory_usage_bytes,
    pool_bytes_per_block,
)
from kvsvc.planner.options import AUTO_FIT_CAP, DEFAULT_BLOCK_SIZE, PlannerOptions
from kvsvc.specs import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SizingContext,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
    sliding_window_of,
    spec_to_dict,
)


@dataclass
class KVCachePlan:
    """Every rank's KV cache config plus the scheduler's view of the pool.

    Attributes:
        worker_configs: per global rank (``pp_rank * tp + tp_rank``), all with ``num_blocks``.
        scheduler_config: the groups with one representative per-layer spec each and every
            layer name of the model; the block-pool core is built from it.
        num_blocks: blocks per worker, the null block included (as vLLM counts).
        block_size: the scheduler's block size (lcm of the group block sizes).
        hash_block_size: granularity of the request's block hashes.
        max_model_len: the resolved length (after auto-fit).
        kv_cache_tokens: ``int(max_concurrency * max_model_len)``.
        max_concurrency: requests of ``max_model_len`` tokens that fit at once (``inf`` for
            a model without KV cache).
        tp_replicas: consecutive TP ranks that hold identical KV for every layer.
        sizing: the limits the plan was sized with.
        layout: ``layer_outer`` or ``block_outer``.
        available_memory: the memory each rank offered (bytes).
        global_groups: the groups over the whole model, with their merged specs.
    """

    worker_configs: list[KVCacheConfig]
    scheduler_config: KVCacheConfig
    num_blocks: int
    block_size: int
    hash_block_size: int
    max_model_len: int
    kv_cache_tokens: int
    max_concurrency: float
    tp_replicas: int
    sizing: SizingContext
    layout: str = "layer_outer"
    available_memory: list[int] = field(default_factory=list)
    global_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    def worker_bytes_per_block(self, rank: int) -> int:
        return pool_bytes_per_block(self.worker_configs[rank].kv_cache_groups)

    def to_dict(self) -> dict[str, Any]:
        """The plan as one JSON-ready object (what ``kvsvc plan --json`` prints)."""
        groups = []
        for index, group in enumerate(self.scheduler_config.kv_cache_groups):
            spec = group.kv_cache_spec
            groups.append(
                {
                    "index": index,
                    "kind": str(spec.kind),
                    "block_size": spec.block_size,
                    "page_size_bytes": spec.page_size_bytes,
                    "num_layers": len(group.layer_names),
                    "sliding_window": sliding_window_of(spec),
                    "blocks_per_request": group_blocks_per_request(spec, self.sizing),
                    "layer_names": list(group.layer_names),
                    "spec": spec_to_dict(spec),
                }
            )
        workers = []
        for rank, config in enumerate(self.worker_configs):
            workers.append(
                {
                    "rank": rank,
                    "num_blocks": config.num_blocks,
                    "bytes_per_block": pool_bytes_per_block(config.kv_cache_groups),
                    "available_memory": (
                        self.available_memory[rank] if rank < len(self.available_memory) else None
                    ),
                    "allocated_bytes": allocated_bytes(config),
                    "tensors": [
                        {
                            "size": t.size,
                            "layers": list(t.shared_by),
                            "offset": t.offset,
                            "block_stride": t.block_stride,
                            "page_stride": page_stride(t, config.num_blocks),
                        }
                        for t in config.kv_cache_tensors
                    ],
                    "groups": [list(g.layer_names) for g in config.kv_cache_groups],
                }
            )
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "hash_block_size": self.hash_block_size,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": (
                None if math.isinf(self.max_concurrency) else round(self.max_concurrency, 6)
            ),
            "tp_replicas": self.tp_replicas,
            "layout": self.layout,
            "sizing": {f.name: getattr(self.sizing, f.name) for f in fields(self.sizing)},
            "groups": groups,
            "workers": workers,
        }


def _describe_difference(a: KVCacheSpec, b: KVCacheSpec) -> str:
    if type(a) is not type(b):
        return f"{type(a).__name__} vs {type(b).__name__}"
    for f in fields(a):
        va, vb = getattr(a, f.name, None), getattr(b, f.name, None)
        if va != vb:
            return f"{f.name} {va!r} vs {vb!r}"
    return "different specs"


def _merge_worker_specs(worker_specs: Sequence[dict[str, KVCacheSpec]]) -> dict[str, KVCacheSpec]:
    """The whole model's specs; every rank holding a layer must report the same spec."""
    merged: dict[str, KVCacheSpec] = {}
    first_rank: dict[str, int] = {}
    for rank, specs in enumerate(worker_specs):
        if not isinstance(specs, dict):
            raise InvalidArgument(
                f"worker_specs[{rank}]",
                f"expected a layer name -> spec map, got {type(specs).__name__}",
            )
        for name, spec in specs.items():
            if not isinstance(spec, KVCacheSpec):
                raise InvalidArgument(
                    f"worker_specs[{rank}][{name!r}]", f"not a KV cache spec: {type(spec).__name__}"
                )
            if name not in merged:
                merged[name] = spec
                first_rank[name] = rank
            elif merged[name] != spec:
                raise PlanningError(
                    f"layer {name!r} has different KV cache specs on rank {first_rank[name]} and "
                    f"rank {rank} ({_describe_difference(merged[name], spec)}); every rank "
                    "holding a layer must report the same spec"
                )
    return merged


def _is_dcp_sharded(spec: KVCacheSpec) -> bool:
    """Decode context parallelism shards attention KV by token; Mamba state is replicated."""
    return all(isinstance(s, AttentionSpec) for s in iter_layer_specs(spec))


def resolve_block_sizes(
    groups: Sequence[KVCacheGroupSpec], options: PlannerOptions
) -> tuple[int, int]:
    """(scheduler block size, hash block size), as vLLM's ``resolve_kv_cache_block_sizes``.

    The scheduler block size is the lcm of the groups' block sizes (attention groups scaled
    by DCP), so every group's blocks end on its boundaries. Hashes are computed at the gcd
    of the prefix-cacheable groups' sizes (or ``prefix_match_unit``), so each group can
    look up its own blocks; when prefix caching is off, or a Mamba group keeps state only
    per request (cache mode other than ``align``), at the scheduler block size.

    Raises:
        PlanningError: for a ``prefix_match_unit`` the group block sizes do not allow.
    """
    dcp = options.dcp_world_size
    pmu = options.prefix_match_unit
    if len(groups) <= 1:
        if not groups:
            return DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE
        spec = groups[0].kv_cache_spec
        size = spec.block_size * (dcp if _is_dcp_sharded(spec) else 1)
        if pmu not in (None, size) and options.enable_prefix_caching:
            raise PlanningError(
                f"invalid prefix_match_unit={pmu}: with a single KV cache group, prefix-cache "
                f"hits land on the block size ({size}); unset it or set it to {size}"
            )
        return size, size

    sizes = [
        g.kv_cache_spec.block_size * (dcp if _is_dcp_sharded(g.kv_cache_spec) else 1)
        for g in groups
    ]
    scheduler = math.lcm(*sizes)
    if not options.enable_prefix_caching:
        return scheduler, scheduler
    if any(
        isinstance(s, MambaSpec) and s.mamba_cache_mode != "align"
        for g in groups
        for s in iter_layer_specs(g.kv_cache_spec)
    ):
        return scheduler, scheduler
    hashing = [
        size
        for g, size in zip(groups, sizes, strict=True)
        if g.kv_cache_spec.participates_in_prefix_caching
    ] or sizes
    hash_size = pmu if pmu is not None else math.gcd(*hashing)
    if any(size % hash_size for size in hashing):
        raise PlanningError(
            f"invalid prefix_match_unit={hash_size}: the block sizes of prefix-cacheable KV "
            f"cache groups must be divisible by it; group block sizes are {sizes}, "
            f"prefix-cacheable {hashing}"
        )
    return scheduler, hash_size


def _layer_tp_replicas(spec: KVCacheSpec, options: PlannerOptions) -> int:
    tp = options.tensor_parallel_size
    if not isinstance(spec, AttentionSpec):
        return 1
    if options.dcp_world_size > 1:
        return 1  # DCP shards attention KV over the ranks: nothing is replicated
    if isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec):
        return tp  # one latent "head", kept whole on every TP rank
    if options.total_num_kv_heads is None:
        return 1
    return max(1, tp // options.total_num_kv_heads)


def tp_replicas(groups: Sequence[KVCacheGroupSpec], options: PlannerOptions) -> int:
    """Consecutive TP ranks that hold identical KV for every layer (1: none replicated)."""
    specs = [s for g in groups for s in iter_layer_specs(g.kv_cache_spec)]
    if not specs:
        return 1
    return reduce(
        math.gcd, (_layer_tp_replicas(s, options) for s in specs), options.tensor_parallel_size
    )


def scheduler_kv_cache_config(
    num_blocks: int, global_groups: Sequence[KVCacheGroupSpec]
) -> KVCacheConfig:
    """The scheduler's view: each group with one representative per-layer spec.

    All layers of a uniform-type group need the same token slots, so any one of them tells
    the block manager how a request grows; tensors are the workers' business.
    """
    groups = []
    for group in global_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        groups.append(KVCacheGroupSpec(list(group.layer_names), spec, group.is_eagle_group))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def max_concurrency(config: KVCacheConfig, ctx: SizingContext) -> float:
    """Requests of ``ctx.max_model_len`` tokens the pool holds at once.

    A request takes whole blocks from every group's table and all groups draw from one
    pool, so its cost is the sum over groups; ``inf`` when it takes none.
    """
    needed = blocks_per_request(config.kv_cache_groups, ctx)
    if needed == 0:
        return math.inf
    return config.num_blocks / needed


def _validate_inputs(
    worker_specs: Sequence[dict[str, KVCacheSpec]],
    available_memory: Sequence[int],
    options: PlannerOptions,
) -> None:
    if not worker_specs:
        raise InvalidArgument("worker_specs", "at least one rank is needed")
    if len(worker_specs) != len(available_memory):
        raise InvalidArgument(
            "available_memory",
            f"has {len(available_memory)} entries for {len(worker_specs)} ranks",
        )
    if len(worker_specs) % options.tensor_parallel_size:
        raise InvalidArgument(
            "tensor_parallel_size",
            f"{options.tensor_parallel_size} does not divide the {len(worker_specs)} ranks",
        )
    for rank, memory in enumerate(available_memory):
        if isinstance(memory, bool) or not isinstance(memory, int):
            raise InvalidArgument(
                f"available_memory[{rank}]", f"must be an integer, got {memory!r}"
            )


def plan_kv_cache(
    worker_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
    options: PlannerOptions,
) -> KVCachePlan:
    """Plan the KV cache of every rank of one engine (see the module docstring).

    Args:
        worker_specs: each rank's ``{layer_name: spec}``, indexed ``pp_rank * tp + tp_rank``.
        available_memory: bytes each rank can give the KV cache, same indexing.
        options: the engine's settings.

    Raises:
        PlanningError: when one request of ``max_model_len`` does not fit a rank (the
            message gives the GiB needed and available and the longest length that fits),
            when ranks disagree on a layer's spec (naming the layer and the ranks), or when
            the layers cannot be grouped or laid out.
        InvalidArgument: for malformed inputs.
    """
    _validate_inputs(worker_specs, available_memory, options)
    merged = _merge_worker_specs(worker_specs)
    if options.dcp_world_size > 1:
        for name, spec in merged.items():
            if isinstance(spec, SlidingWindowSpec):
                raise PlanningError(
                    f"decode context parallelism does not support sliding-window layers "
                    f"(layer {name!r}); use dcp_world_size=1"
                )

    try:
        global_groups = get_kv_cache_groups(
            merged,
            layout=options.layout,
            disable_hybrid_kv_cache_manager=options.disable_hybrid_kv_cache_manager,
        )
    except SpecMergeError as exc:
        raise PlanningError(f"cannot group the layers: {exc}") from None
    projected = [project_groups_to_worker(global_groups, specs) for specs in worker_specs]
    holds_layers = [any(g.layer_names for g in groups) for groups in projected]
    bytes_per_block = [pool_bytes_per_block(groups) for groups in projected]

    # With an override the pool is exactly that many blocks, whatever the memory; size the
    # checks (and auto-fit) against it.
    memory = list(available_memory)
    if options.num_gpu_blocks_override is not None:
        memory = [
            options.num_gpu_blocks_override * bpb if held else mem
            for held, bpb, mem in zip(holds_layers, bytes_per_block, memory, strict=True)
        ]
    # The block pool holds one block back as the null block: plan with the usable rest.
    check_memory = [
        mem - bpb if held else mem
        for held, bpb, mem in zip(holds_layers, bytes_per_block, memory, strict=True)
    ]

    upper = options.derived_max_model_len or AUTO_FIT_CAP
    max_model_len = upper if options.auto_fit else options.max_model_len
    ctx = SizingContext(
        max_model_len=max_model_len,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_num_encoder_input_tokens=options.max_num_encoder_input_tokens,
        dcp_world_size=options.dcp_world_size,
    )

    if options.auto_fit and any(holds_layers):
        fitted = upper
        # TP ranks of one stage hold the same layers: search once per (layers, memory).
        searched: dict[tuple[object, ...], int] = {}
        for held, groups, mem in zip(holds_layers, projected, check_memory, strict=True):
            if not held:
                continue
            key = (mem, *(tuple(g.layer_names) for g in groups))
            if key not in searched:
                searched[key] = estimate_max_model_len(groups, ctx, mem, upper)
            fitted = min(fitted, searched[key])
        if fitted <= 0:
            raise PlanningError(
                "Cannot auto-fit max_model_len (--max-model-len -1): not enough memory to "
                f"serve even a single token; {MORE_MEMORY_HINT}."
            )
        ctx = ctx.with_max_model_len(fitted)

    for rank, (held, groups, mem) in enumerate(
        zip(holds_layers, projected, check_memory, strict=True)
    ):
        if not held:
            continue
        check_enough_memory(
            mem,
            partial(max_memory_usage_bytes, groups, ctx),
            ctx.max_model_len,
            partial(estimate_max_model_len, groups, ctx, upper=ctx.max_model_len),
            rank=rank,
        )

    configs = [
        kv_cache_config_from_groups(
            groups, mem, layout=options.layout, num_blocks_override=options.num_gpu_blocks_override
        )
        for groups, mem in zip(projected, memory, strict=True)
    ]
    # One scheduler hands the same block ids to every rank: all get the smallest count, and
    # their tensors shrink to it.
    counts = [c.num_blocks for c, held in zip(configs, holds_layers, strict=True) if held]
    num_blocks = min(counts) if counts else 1
    for rank, config in enumerate(configs):
        if config.num_blocks != num_blocks:
            groups = projected[rank]
            if holds_layers[rank]:
                configs[rank] = kv_cache_config_from_groups(
                    groups, num_blocks * bytes_per_block[rank], layout=options.layout
                )
            else:
                configs[rank] = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)

    scheduler = scheduler_kv_cache_config(num_blocks, global_groups)
    block_size, hash_block_size = resolve_block_sizes(global_groups, options)
    concurrency = max_concurrency(scheduler, ctx)
    tokens = 0 if math.isinf(concurrency) else int(concurrency * ctx.max_model_len)
    return KVCachePlan(
        worker_configs=configs,
        scheduler_config=scheduler,
        num_blocks=num_blocks,
        block_size=block_size,
        hash_block_size=hash_block_size,
        max_model_len=ctx.max_model_len,
        kv_cache_tokens=tokens,
        max_concurrency=concurrency,
        tp_replicas=tp_replicas(global_groups, options),
        sizing=ctx,
        layout=options.layout,
        available_memory=list(available_memory),
        global_groups=list(global_groups),
    )
