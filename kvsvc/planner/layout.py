"""A worker's raw tensors: how many blocks, which allocations, where each layer's page is.

Two layouts (see :mod:`kvsvc.specs.config`)::

    layer-outer: tensor i = layer slot i, shared by the i-th layer of every group
        tensor 0: | blk 0 | blk 1 | ... |      (group 0 layer 0, group 1 layer 0, ...)
        tensor 1: | blk 0 | blk 1 | ... |      (group 0 layer 1, group 1 layer 1, ...)

    block-outer: one backing; inside a block, each group's layers side by side
        backing: | blk 0 [ A | B | C ] | blk 1 [ A | B | C ] | ...
                 |<- bytes_per_block ->|   (group 1 aliases the same bytes from offset 0)

A block id is owned by one group at a time, so groups alias the same bytes in both.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsvc.errors import PlanningError
from kvsvc.planner.memory import layer_page_sizes, pool_bytes_per_block
from kvsvc.planner.options import BLOCK_OUTER
from kvsvc.specs import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
)


def project_groups_to_worker(
    global_groups: Sequence[KVCacheGroupSpec], worker_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """The global groups restricted to one worker's layers (its pipeline stage).

    Every group stays, possibly empty: block ids are global, so a stage must budget for
    groups it holds no layer of. A uniform-type group keeps only the worker's layer specs.
    """
    projected: list[KVCacheGroupSpec] = []
    for group in global_groups:
        names = [name for name in group.layer_names if name in worker_spec]
        if len(names) == len(group.layer_names):
            projected.append(group)
            continue
        spec = group.kv_cache_spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs):
            spec = UniformTypeKVCacheSpecs(
                block_size=spec.block_size,
                kv_cache_specs={name: spec.kv_cache_specs[name] for name in names},
            )
        projected.append(
            KVCacheGroupSpec(names, spec, is_eagle_group=group.is_eagle_group and bool(names))
        )
    return projected


def _layer_outer_tensors(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int
) -> list[KVCacheTensor]:
    tensors = []
    pages_of = [layer_page_sizes(g) for g in groups]
    num_slots = max(len(g.layer_names) for g in groups)
    for slot in range(num_slots):
        names = [g.layer_names[slot] for g in groups if slot < len(g.layer_names)]
        pages = {p[slot] for p in pages_of if slot < len(p)}
        if len(pages) != 1:
            raise PlanningError(
                f"layers {names} would share one layer-outer tensor but have different page "
                f"sizes {sorted(pages)}; plan with layout='block_outer' "
                "(kvsvc plan --layout block_outer)"
            )
        tensors.append(KVCacheTensor(size=pages.pop() * num_blocks, shared_by=names))
    return tensors


def _block_outer_tensors(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, bytes_per_block: int
) -> list[KVCacheTensor]:
    at_offset: dict[int, list[str]] = {}
    for group in groups:
        offset = 0
        for name, page in zip(group.layer_names, layer_page_sizes(group), strict=True):
            at_offset.setdefault(offset, []).append(name)
            offset += page
        assert offset <= bytes_per_block
    size = bytes_per_block * num_blocks
    return [
        KVCacheTensor(size=size, shared_by=names, offset=offset, block_stride=bytes_per_block)
        for offset, names in at_offset.items()
    ]


def kv_cache_config_from_groups(
    groups: Sequence[KVCacheGroupSpec],
    available_memory: int,
    *,
    layout: str,
    num_blocks_override: int | None = None,
) -> KVCacheConfig:
    """One worker's config: as many blocks as ``available_memory`` holds, and its tensors.

    A worker without any layer (an attention-free model) gets the one null block the block
    pool always needs.

    Raises:
        PlanningError: when the layer-outer layout cannot express the pages.
    """
    if not any(g.layer_names for g in groups):
        return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=list(groups))
    bytes_per_block = pool_bytes_per_block(groups)
    num_blocks = available_memory // bytes_per_block
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
    if layout == BLOCK_OUTER:
        tensors = _block_outer_tensors(groups, num_blocks, bytes_per_block)
    else:
        tensors = _layer_outer_tensors(groups, num_blocks)
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=list(groups)
    )


def allocated_bytes(config: KVCacheConfig) -> int:
    """Bytes the worker allocates for ``config``: packed tensors alias one backing."""
    packed = [t.size for t in config.kv_cache_tensors if t.is_packed]
    separate = sum(t.size for t in config.kv_cache_tensors if not t.is_packed)
    return separate + (max(packed) if packed else 0)


def page_stride(tensor: KVCacheTensor, num_blocks: int) -> int:
    """Bytes from one block's page to the next inside ``tensor``."""
    if tensor.is_packed:
        return tensor.block_stride
    return tensor.size // num_blocks if num_blocks else 0
