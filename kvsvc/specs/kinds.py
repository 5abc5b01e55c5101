"""The spec of a KV cache group, merging layers into it, and every spec kind by name.

A group is one kind of layer, or a uniform-type bundle (:class:`UniformTypeKVCacheSpecs`)
of layers that need the same token slots with different page sizes. :data:`SPEC_TYPES`
names every concrete kind by its ``type_name`` (how JSON and protobuf spell it). The kinds
themselves live in :mod:`kvsvc.specs.attention` and :mod:`kvsvc.specs.mamba`, on
:mod:`kvsvc.specs.base`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

from kvsvc.specs import attention
from kvsvc.specs.base import KVCacheSpec, KVCacheSpecKind, SizingContext, cdiv
from kvsvc.specs.mamba import MambaSpec


@dataclass(frozen=True, kw_only=True, eq=False)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers that need the same token slots but differ in page size, kept in one group.

    The group's page is the sum of its layers' pages: one block id addresses one page in
    every member layer.
    """

    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    type_name: ClassVar[str] = "uniform_type"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UniformTypeKVCacheSpecs):
            return NotImplemented
        return self.block_size == other.block_size and self.kv_cache_specs == other.kv_cache_specs

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def kind(self) -> KVCacheSpecKind:
        kinds = {spec.kind for spec in self.kv_cache_specs.values()}
        if len(kinds) == 1:
            return next(iter(kinds))
        if all(isinstance(s, attention.FullAttentionSpec) for s in self.kv_cache_specs.values()):
            return KVCacheSpecKind.FULL_ATTENTION
        return KVCacheSpecKind.UNKNOWN

    @property
    def participates_in_prefix_caching(self) -> bool:
        return all(s.participates_in_prefix_caching for s in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_pages(self, ctx: SizingContext) -> int:
        return max(
            cdiv(spec.max_memory_usage_bytes(ctx), spec.page_size_bytes)
            for spec in self.kv_cache_specs.values()
        )

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        return self.max_memory_usage_pages(ctx) * self.page_size_bytes

    def max_num_blocks_per_req(self, ctx: SizingContext, max_len: int) -> int:
        widths = {s.max_num_blocks_per_req(ctx, max_len) for s in self.kv_cache_specs.values()}
        if len(widths) != 1:
            raise ValueError(
                f"layers in one KV cache group need different block-table widths: {sorted(widths)}"
            )
        return next(iter(widths))

    def get_page_sizes(self) -> list[int]:
        return sorted({spec.page_size_bytes for spec in self.kv_cache_specs.values()})

    def get_max_layers_per_page_size(self) -> int:
        """Layers of the most common page size (the repeat count of a 1:1 layer pattern)."""
        return Counter(s.page_size_bytes for s in self.kv_cache_specs.values()).most_common(1)[0][1]

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size=block_size,
            kv_cache_specs={
                name: spec.copy_with_new_block_size(block_size)
                for name, spec in self.kv_cache_specs.items()
            },
        )

    @classmethod
    def is_uniform_type(cls, specs: dict[str, KVCacheSpec]) -> bool:
        """Whether all layers share a block size and need the same token slots."""
        if not specs:
            return False
        if len({spec.block_size for spec in specs.values()}) > 1:
            return False
        first = next(iter(specs.values()))
        return first.is_uniform_with_collection(specs.values())

    @classmethod
    def from_specs(cls, specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        if not cls.is_uniform_type(specs):
            return None
        return cls(block_size=next(iter(specs.values())).block_size, kv_cache_specs=dict(specs))


def iter_layer_specs(spec: KVCacheSpec) -> Iterable[KVCacheSpec]:
    """The per-layer specs behind a group spec (itself unless it is a uniform-type bundle)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs.values()
    return (spec,)


def sliding_window_of(spec: KVCacheSpec) -> int | None:
    """The sliding window a group spec drops blocks by, if it does."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {sliding_window_of(s) for s in spec.kv_cache_specs.values()}
        return next(iter(windows)) if len(windows) == 1 else None
    if isinstance(spec, attention.SlidingWindowSpec):
        return spec.sliding_window
    return None


def merge_layer_specs(named_specs: dict[str, KVCacheSpec]) -> KVCacheSpec:
    """Merge the specs of the named layers into the one spec their group uses.

    Raises:
        SpecMergeError: naming the first pair of layers that disagree and on what.
    """
    if not named_specs:
        raise ValueError("cannot merge an empty set of layer specs")
    names = list(named_specs)
    specs = list(named_specs.values())
    return type(specs[0]).merge(specs, names)


SPEC_TYPES: dict[str, type[KVCacheSpec]] = {
    cls.type_name: cls
    for cls in (
        attention.FullAttentionSpec,
        attention.MLAAttentionSpec,
        attention.HiddenStateCacheSpec,
        attention.SinkFullAttentionSpec,
        attention.SlidingWindowSpec,
        attention.SlidingWindowMLASpec,
        attention.ChunkedLocalAttentionSpec,
        MambaSpec,
        attention.EncoderOnlyAttentionSpec,
        attention.CrossAttentionSpec,
        UniformTypeKVCacheSpecs,
    )
}
