"""Which per-attention-type manager serves a KV cache group, and building it.

The managers themselves: :mod:`kvsvc.core.single_type_manager` (the base, full attention,
sinks, cross attention), :mod:`kvsvc.core.window_managers` (sliding window, chunked local)
and :mod:`kvsvc.core.mamba_manager` (state-space).
"""

from __future__ import annotations

from kvsvc.core.block_pool import BlockPool
from kvsvc.core.mamba_manager import MambaManager
from kvsvc.core.single_type_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
)
from kvsvc.core.window_managers import ChunkedLocalAttentionManager, SlidingWindowManager
from kvsvc.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def representative_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The per-layer spec a group's manager follows (a uniform-type group's first layer)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.first_spec
    return spec


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class of a group spec.

    Raises:
        ValueError: a spec kind the scheduler side does not manage (encoder-only layers
            have no KV cache to manage).
    """
    spec = representative_spec(spec)
    # Most specific first: sink and MLA are full attention, sliding-window MLA is sliding.
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager
    if isinstance(spec, SinkFullAttentionSpec):
        return SinkFullAttentionManager
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, MambaSpec):
        return MambaManager
    raise ValueError(
        f"KV cache group spec {type(spec).__name__} ({spec.kind.value}) has no block manager; "
        "managed kinds: full/MLA/sink attention, sliding window, chunked local, Mamba, "
        "cross attention"
    )


def make_manager(
    spec: KVCacheSpec,
    pool: BlockPool,
    group_id: int,
    *,
    enable_caching: bool,
    hash_block_size: int,
) -> SingleTypeKVCacheManager:
    """The manager for one group (a uniform-type group is managed by its first layer's type)."""
    cls = manager_class_for(spec)
    return cls(
        representative_spec(spec),
        pool,
        group_id,
        enable_caching=enable_caching,
        hash_block_size=hash_block_size,
    )
