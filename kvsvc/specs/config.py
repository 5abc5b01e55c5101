"""The memory plan handed to a worker: how many blocks, which raw tensors, which groups.

Two tensor layouts exist (see ``KVCacheTensor``):

    layer-outer (default; one tensor per layer slot, shared by one layer of each group)
        tensor i: | blk 0 | blk 1 | ... | blk N-1 |        block b at b * page_size_bytes

    block-outer (packed; one backing tensor, every layer's page side by side in a block)
        backing:  | blk 0 [ A | B | C ] | blk 1 [ A | B | C ] | ...
                  |<-- block_stride -->|   layer B at b * block_stride + offset(B)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsvc.specs.attention import AttentionSpec
from kvsvc.specs.base import KVCacheSpec
from kvsvc.specs.kinds import UniformTypeKVCacheSpecs, iter_layer_specs
from kvsvc.specs.mamba import MambaSpec


@dataclass(slots=True)
class KVCacheTensor:
    """One raw allocation (int8 bytes) and the layers that view it.

    Attributes:
        size: bytes to allocate.
        shared_by: layer names whose caches live in this allocation. In the layer-outer
            layout these are one layer from each KV cache group: a block id is owned by
            exactly one group at a time, so the groups can share the bytes.
        offset: byte offset of these layers' page inside a block (block-outer layout).
        block_stride: bytes from one block to the next in a packed (block-outer) backing;
            0 means pages are contiguous (stride = the layer's page size).
    """

    size: int
    shared_by: list[str]
    offset: int = 0
    block_stride: int = 0

    @property
    def is_packed(self) -> bool:
        return self.block_stride > 0


@dataclass(slots=True)
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec the manager treats them as."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass(slots=True)
class KVCacheConfig:
    """One worker's plan (or, with per-layer specs collapsed, the scheduler's view)."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    @property
    def has_mamba_layers(self) -> bool:
        return any(
            isinstance(spec, MambaSpec)
            for group in self.kv_cache_groups
            for spec in iter_layer_specs(group.kv_cache_spec)
        )

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        precisions = {
            (spec.dtype, spec.kv_quant_mode)
            for group in self.kv_cache_groups
            for spec in iter_layer_specs(group.kv_cache_spec)
            if isinstance(spec, AttentionSpec)
        }
        return len(precisions) > 1

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether fresh blocks must be zeroed before use.

        Mamba state is read before it is fully written; in a mixed-precision cache a block
        reused by another group would decode stale bytes as NaN/Inf. Uniform attention
        caches are always written before read, so they skip the cost.
        """
        return self.has_mamba_layers or self.has_mixed_precision_kv_cache

    @property
    def layer_names(self) -> list[str]:
        return [name for group in self.kv_cache_groups for name in group.layer_names]

    def layer_spec(self, layer_name: str) -> KVCacheSpec:
        """The spec of one layer (looking inside uniform-type groups)."""
        for group in self.kv_cache_groups:
            if layer_name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    return spec.kv_cache_specs[layer_name]
                return spec
        raise KeyError(layer_name)
