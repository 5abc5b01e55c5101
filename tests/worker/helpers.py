"""Plans built by hand for the worker tests, and byte-level probes of views."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvsvc.specs import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor


def layer_outer(
    num_blocks: int, groups: Sequence[tuple[Sequence[str], KVCacheSpec]]
) -> KVCacheConfig:
    """A layer-outer plan: tensor i is shared by the i-th layer of every group."""
    group_specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    tensors = []
    for slot in range(max(len(names) for names, _ in groups)):
        owners = [(names[slot], spec) for names, spec in groups if slot < len(names)]
        pages = {spec_page(spec, name) for name, spec in owners}
        assert len(pages) == 1, f"slot {slot}: pages {pages} differ"
        tensors.append(
            KVCacheTensor(size=pages.pop() * num_blocks, shared_by=[n for n, _ in owners])
        )
    return KVCacheConfig(num_blocks, tensors, group_specs)


def spec_page(spec: KVCacheSpec, name: str) -> int:
    from kvsvc.specs import UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[name].page_size_bytes
    return spec.page_size_bytes


def block_outer(
    num_blocks: int, groups: Sequence[tuple[Sequence[str], KVCacheSpec]]
) -> KVCacheConfig:
    """A packed plan: every group's layers side by side inside one block stride."""
    group_specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    stride = max(sum(spec_page(spec, n) for n in names) for names, spec in groups)
    at_offset: dict[int, list[str]] = {}
    for names, spec in groups:
        offset = 0
        for name in names:
            at_offset.setdefault(offset, []).append(name)
            offset += spec_page(spec, name)
    tensors = [
        KVCacheTensor(stride * num_blocks, names, offset=offset, block_stride=stride)
        for offset, names in at_offset.items()
    ]
    return KVCacheConfig(num_blocks, tensors, group_specs)


def fill_nonzero(view: torch.Tensor) -> None:
    """Write a value none of whose bytes is zero (so every written byte shows up)."""
    view.fill_(7 if not view.dtype.is_floating_point else 1.1)


def changed_bytes(raw: torch.Tensor) -> list[int]:
    return raw.view(torch.int8).nonzero().flatten().tolist()


def byte_range(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def byte_offset(view: torch.Tensor, index: Sequence[int]) -> int:
    """Byte address of ``view[index]`` inside its storage."""
    element = view.storage_offset() + sum(i * s for i, s in zip(index, view.stride(), strict=True))
    return element * view.element_size()
