"""Bytes per block, what one request needs, and whether (or how long a request) fits.

All sizing is per worker, on the groups projected onto that worker: with pipeline
parallelism a stage holds only its layers, but block ids are shared by every stage, so a
request still takes blocks from *every* group's table on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvsvc.errors import PlanningError
from kvsvc.specs import (
    KVCacheGroupSpec,
    KVCacheSpec,
    SizingContext,
    UniformTypeKVCacheSpecs,
    cdiv,
)
from kvsvc.units import format_sizes

# What a memory error tells the user to change: kvsvc's own flags (vLLM's engine flags of
# the same meaning share the names, except --kv-cache-memory-bytes).
MORE_MEMORY_HINT = (
    "give the KV cache more memory (--kv-cache-memory, or --gpu-memory-utilization on a GPU)"
)


def layer_spec(group: KVCacheGroupSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer of a group (looking inside a uniform-type group)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def layer_page_sizes(group: KVCacheGroupSpec) -> list[int]:
    """The page size of each layer of a group, in ``layer_names`` order."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [spec.kv_cache_specs[name].page_size_bytes for name in group.layer_names]
    # One spec for the whole group: compute its page once (planning a 128-layer model
    # would otherwise spend most of its time here).
    return [spec.page_size_bytes] * len(group.layer_names)


def pool_bytes_per_block(groups: Sequence[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs a worker: the widest group's pages over its layers.

    Every group draws its block ids from one pool and a block belongs to one group at a
    time, so groups share the bytes and a block is as wide as the widest group. 0 when the
    worker holds no layers.
    """
    return max((sum(layer_page_sizes(g)) for g in groups), default=0)


def group_blocks_per_request(spec: KVCacheSpec, ctx: SizingContext) -> int:
    """Blocks one request of ``ctx.max_model_len`` tokens takes from a group's table."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.max_memory_usage_pages(ctx)
    return cdiv(spec.max_memory_usage_bytes(ctx), spec.page_size_bytes)


def blocks_per_request(groups: Sequence[KVCacheGroupSpec], ctx: SizingContext) -> int:
    """Blocks one request takes from the shared pool: the sum over groups."""
    return sum(group_blocks_per_request(g.kv_cache_spec, ctx) for g in groups)


def max_memory_usage_bytes(groups: Sequence[KVCacheGroupSpec], ctx: SizingContext) -> int:
    """Bytes one request of ``ctx.max_model_len`` tokens needs on a worker.

    Counted in whole pool blocks, so padding layers (a group narrower than the widest) are
    paid for: 8 full + 9 sliding layers cost like 9 + 9.
    """
    if not groups:
        return 0
    return pool_bytes_per_block(groups) * blocks_per_request(groups, ctx)


def estimate_max_model_len(
    groups: Sequence[KVCacheGroupSpec], ctx: SizingContext, available_memory: int, upper: int
) -> int:
    """The largest length in ``[1, upper]`` one request of which fits; 0 if none does.

    Binary search: a request's memory never shrinks as its length grows.
    """

    bytes_per_block = pool_bytes_per_block(groups)  # independent of the length

    def fits(model_len: int) -> bool:
        needed = blocks_per_request(groups, ctx.with_max_model_len(model_len)) * bytes_per_block
        return needed <= available_memory

    if not fits(1):
        return 0
    low, high, best = 1, upper, 1
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def check_enough_memory(
    available_memory: int,
    needed_memory: Callable[[], int],
    max_model_len: int,
    estimate: Callable[[int], int],
    *,
    rank: int | None = None,
) -> None:
    """Raise unless one request of ``max_model_len`` tokens fits ``available_memory``.

    ``available_memory`` is already net of the null block the pool holds back.

    Raises:
        PlanningError: saying how much is needed and available, the largest length that
            fits, and what to change.
    """
    where = f" on rank {rank}" if rank is not None else ""
    if available_memory <= 0:
        (available,) = format_sizes(available_memory)
        raise PlanningError(
            f"No memory is left for the KV cache blocks{where} ({available} once the null "
            f"block is held back): {MORE_MEMORY_HINT}."
        )
    needed = needed_memory()
    if needed <= available_memory:
        return
    estimated = estimate(available_memory)
    estimated_msg = (
        f"Based on the available memory, the estimated maximum model length is {estimated}. "
        if estimated > 0
        else ""
    )
    needed_text, available_text = format_sizes(needed, available_memory)
    raise PlanningError(
        f"To serve at least one request of max_model_len {max_model_len} tokens "
        "(--max-model-len), "
        f"{needed_text} of KV cache is needed{where}, more than the available KV cache "
        f"memory ({available_text}, the null block held back). {estimated_msg}"
        f"Either {MORE_MEMORY_HINT}, or lower --max-model-len."
    )
