"""Allocate a plan's raw tensors and build the per-layer views an engine binds.

Two steps, as in vLLM's worker (``_allocate_kv_cache`` / ``_reshape_kv_cache``):

1. :func:`allocate_kv_cache` allocates one raw ``int8`` tensor per planned
   :class:`~kvsvc.specs.KVCacheTensor`. Every packed (block-outer) entry aliases one shared
   backing. Memory is zeroed only when the plan needs it
   (:attr:`~kvsvc.specs.KVCacheConfig.needs_kv_cache_zeroing`): zeroing a large budget
   costs seconds and commits every page up front.
2. :func:`reshape_kv_cache` reinterprets those bytes per layer (``tensor.view(dtype)``, no
   copy) in the layout of the layer's attention backend (:mod:`kvsvc.worker.layouts`)::

       layer-outer, unpadded    raw.view(dtype).view(memory shape).permute(...)
       layer-outer, padded      as_strided: block stride = the padded page
       packed (block-outer)     raw.view(-1, block_stride)[:, offset:offset + page]
       Mamba                    one as_strided tensor per state, block stride = the page

   Layers of different KV cache groups that share one tensor then see the same bytes for
   the same block id; a layer that shares another layer's cache (``kv_sharing_target``)
   gets its target's view itself.

A block id ``b`` always addresses bytes inside ``[b * page, (b + 1) * page)`` of its
tensor, whatever the layout: when K/V-first views (whose K and V halves are far apart) share
a tensor with Mamba state or with blocks-first views, the views are restrided so that the
groups cannot step on each other's blocks (vLLM's hybrid and mixed-layout alignment).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import TypeAlias

import torch

from kvsvc.errors import InvalidArgument
from kvsvc.specs import (
    DTYPE_SIZES,
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    canonical_dtype,
    dtype_size,
)
from kvsvc.worker.errors import AllocationError
from kvsvc.worker.layouts import DEFAULT_LAYOUT, AttentionLayout, LayoutKind, layout_for

# What an engine binds per layer: one tensor for attention, one per state for Mamba.
KVCacheView: TypeAlias = torch.Tensor | list[torch.Tensor]

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec's dtype name (``"bfloat16"``, ``"float8_e4m3fn"``, ...).

    Raises:
        InvalidArgument: for a name kvsvc does not know or this torch build lacks.
    """
    try:
        key = canonical_dtype(name)
    except ValueError as exc:
        raise InvalidArgument("dtype", str(exc)) from None
    dtype = _TORCH_DTYPES.get(key)
    if dtype is None:
        raise InvalidArgument("dtype", f"this torch build ({torch.__version__}) has no {key}")
    assert dtype.itemsize == DTYPE_SIZES[key], key
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The spec name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def parse_device(device: str) -> torch.device:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` as a torch device.

    Raises:
        InvalidArgument: naming ``device`` for anything else.
    """
    text = device.strip().lower()
    valid = text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())
    if not valid:
        raise InvalidArgument("device", f"expected cpu, cuda or cuda:N, got {device!r}")
    return torch.device(text)


# --------------------------------------------------------------------------- allocation


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where one layer's cache lives: its plan tensor and the packing, if any."""

    tensor_index: int
    tensor: KVCacheTensor


def _placements(config: KVCacheConfig) -> dict[str, _Placement]:
    """Map every planned layer to its tensor, checking each layer has exactly one.

    Raises:
        AllocationError: a layer in no tensor or in two, or a tensor naming an unknown layer.
    """
    planned = config.layer_names
    planned_set = set(planned)
    out: dict[str, _Placement] = {}
    for index, tensor in enumerate(config.kv_cache_tensors):
        if tensor.size <= 0:
            raise AllocationError(f"plan tensor {index} has size {tensor.size}")
        for name in tensor.shared_by:
            if name not in planned_set:
                raise AllocationError(
                    f"plan tensor {index} names layer {name!r}, which is in no KV cache group"
                )
            if name in out:
                raise AllocationError(
                    f"layer {name!r} is in plan tensors {out[name].tensor_index} and {index}"
                )
            out[name] = _Placement(index, tensor)
    missing = [name for name in planned if name not in out]
    if missing:
        raise AllocationError(f"the plan gives no tensor to layer(s) {', '.join(missing)}")
    return out


def _check_packed(config: KVCacheConfig) -> KVCacheTensor | None:
    packed = [t for t in config.kv_cache_tensors if t.is_packed]
    if not packed:
        return None
    first = packed[0]
    for t in packed[1:]:
        if (t.size, t.block_stride) != (first.size, first.block_stride):
            raise AllocationError(
                "packed plan tensors must share one backing: sizes/block strides "
                f"{first.size}/{first.block_stride} and {t.size}/{t.block_stride} differ"
            )
    if first.size != first.block_stride * config.num_blocks:
        raise AllocationError(
            f"packed backing of {first.size} bytes is not num_blocks={config.num_blocks} "
            f"blocks of block_stride={first.block_stride} bytes"
        )
    return first


def allocate_kv_cache(
    config: KVCacheConfig,
    device: torch.device | str,
    *,
    zero: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Allocate the plan's raw byte tensors.

    Args:
        config: this worker's plan.
        device: where to allocate (``"cpu"``, ``"cuda:0"``, ...).
        zero: zero the bytes; by default only when the plan needs it (Mamba state or a
            mixed-precision cache, see ``KVCacheConfig.needs_kv_cache_zeroing``).

    Returns:
        ``{layer_name: raw int8 tensor}``; layers sharing an allocation map to the same
        tensor object (every packed layer to the one backing).

    Raises:
        AllocationError: when the plan's tensors and groups disagree.
    """
    if isinstance(device, str):
        device = parse_device(device)
    placements = _placements(config)
    _check_packed(config)
    if zero is None:
        zero = config.needs_kv_cache_zeroing
    factory = torch.zeros if zero else torch.empty
    raw: dict[str, torch.Tensor] = {}
    by_index: dict[int, torch.Tensor] = {}
    backing: torch.Tensor | None = None
    for name, place in placements.items():
        tensor = by_index.get(place.tensor_index)
        if tensor is None:
            if place.tensor.is_packed:
                if backing is None:
                    backing = factory(place.tensor.size, dtype=torch.int8, device=device)
                tensor = backing
            else:
                tensor = factory(place.tensor.size, dtype=torch.int8, device=device)
            by_index[place.tensor_index] = tensor
        raw[name] = tensor
    return raw


def allocated_bytes(raw: Mapping[str, torch.Tensor]) -> int:
    """Bytes held by the distinct allocations behind ``raw`` (shared ones counted once)."""
    seen: dict[int, int] = {}
    for tensor in raw.values():
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------- views


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return strides


def _exact_div(numerator: int, denominator: int, what: str) -> int:
    if denominator <= 0 or numerator % denominator:
        raise AllocationError(f"{what}: {numerator} is not a multiple of {denominator}")
    return numerator // denominator


def _attention_page_bytes(spec: AttentionSpec) -> int:
    """Bytes a view of one block covers (the page without padding)."""
    return spec.unpadded_page_size_bytes


def _row_elements(layer: str, spec: AttentionSpec, layout: AttentionLayout) -> int:
    """Elements of the dtype one token of one head stores in ``layout``.

    Per-token-head scales and packed fp4 bytes live inside the row, so the row of a
    quantised cache is wider than ``head_size`` (e.g. ``head_size + 4`` bytes for int8 with
    a float32 scale per token and head): the engine re-views the bytes it knows.
    """
    page = _attention_page_bytes(spec)
    slots = spec.storage_block_size
    # K/V-pair layouts hold two rows (K and V) per token and head; the others one.
    per_row = slots * spec.num_kv_heads
    if layout.kind is LayoutKind.KV_PAIR:
        per_row *= 2
    what = f"layer {layer!r}: the {layout.name} layout of a {page}-byte page"
    row_bytes = _exact_div(page, per_row, what + " into rows")
    return _exact_div(row_bytes, dtype_size(spec.dtype), what + f" into {spec.dtype} elements")


def _attention_view(
    layer: str,
    raw: torch.Tensor,
    spec: AttentionSpec,
    layout: AttentionLayout,
    num_blocks: int,
    packing: tuple[int, int] | None,
    kernel_block_size: int | None,
) -> torch.Tensor:
    dtype = torch_dtype(spec.dtype)
    elem = dtype.itemsize
    slots = spec.storage_block_size
    kernel_bs = kernel_block_size or slots
    if kernel_bs <= 0 or slots % kernel_bs:
        raise InvalidArgument(
            f"kernel_block_size[{layer}]", f"{kernel_bs} does not divide the {slots}-slot block"
        )
    per_block = slots // kernel_bs
    kernel_blocks = num_blocks * per_block
    row = _row_elements(layer, spec, layout)
    shape = layout.shape(kernel_blocks, kernel_bs, spec.num_kv_heads, row)
    order = layout.stride_order
    assert sorted(order) == list(range(len(shape))), (layout.name, order)
    memory_shape = tuple(shape[i] for i in order)
    inverse = [order.index(i) for i in range(len(order))]
    block_outermost = layout.block_dim == 0 and order[0] == 0

    if packing is not None:
        offset, block_stride = packing
        if not block_outermost:
            raise AllocationError(
                f"layer {layer!r}: a packed plan needs a blocks-first layout, got {layout.name}"
            )
        if per_block != 1:
            raise AllocationError(
                f"layer {layer!r}: a packed plan needs kernel_block_size == the block's "
                f"{slots} slots, got {kernel_bs}"
            )
        page = prod(shape[1:]) * elem
        if offset + page > block_stride:
            raise AllocationError(
                f"layer {layer!r}: page at offset {offset} of {page} bytes overruns the "
                f"block stride {block_stride}"
            )
        if offset % elem or block_stride % elem:
            raise AllocationError(
                f"layer {layer!r}: offset {offset} / block stride {block_stride} are not "
                f"aligned to {spec.dtype}"
            )
        view = raw.view(-1, block_stride)[:, offset : offset + page].view(dtype).view(memory_shape)
        return view.permute(*inverse)

    page_stride_bytes = spec.page_size_bytes // per_block
    unpadded = _attention_page_bytes(spec) // per_block
    if page_stride_bytes == unpadded:
        return raw.view(dtype).view(memory_shape).permute(*inverse)
    # Padded pages: only the block stride changes; every other stride already steps inside
    # the unpadded part of a page (so only blocks-first layouts can skip the padding).
    if not block_outermost:
        raise AllocationError(
            f"layer {layer!r}: padded pages ({spec.page_size_bytes} bytes for "
            f"{_attention_page_bytes(spec)}) need a blocks-first layout, got {layout.name}"
        )
    if spec.page_size_bytes % per_block:
        raise AllocationError(
            f"layer {layer!r}: padded page {spec.page_size_bytes} does not split into "
            f"{per_block} kernel blocks"
        )
    strides = _contiguous_strides(memory_shape)
    strides[0] = _exact_div(page_stride_bytes, elem, f"layer {layer!r}: padded page")
    view = torch.as_strided(raw.view(dtype), size=memory_shape, stride=strides)
    return view.permute(*inverse)


def _mamba_views(
    layer: str,
    raw: torch.Tensor,
    spec: MambaSpec,
    num_blocks: int,
    packing: tuple[int, int] | None,
) -> list[torch.Tensor]:
    """One strided tensor per state: ``(num_blocks, *shape)`` stepping a whole page per block."""
    base, page = packing if packing is not None else (0, spec.page_size_bytes)
    views = []
    offset = base
    for shape, name in zip(spec.shapes, spec.dtypes, strict=True):
        dtype = torch_dtype(name)
        elem = dtype.itemsize
        what = f"layer {layer!r}: mamba state {tuple(shape)} of {name}"
        stride0 = _exact_div(page, elem, what + " page stride")
        start = _exact_div(offset, elem, what + " offset")
        views.append(
            torch.as_strided(
                raw.view(dtype),
                size=(num_blocks, *shape),
                stride=(stride0, *_contiguous_strides(shape)),
                storage_offset=start,
            )
        )
        offset += prod(shape) * elem
    if offset - base > page:
        raise AllocationError(
            f"layer {layer!r}: mamba states take {offset - base} bytes, the page {page}"
        )
    return views


def _blocks_in(layer: str, place: _Placement, spec: KVCacheSpec, num_blocks: int) -> int:
    tensor = place.tensor
    if tensor.is_packed:
        return tensor.size // tensor.block_stride
    page = spec.page_size_bytes
    if tensor.size % page or tensor.size // page != num_blocks:
        raise AllocationError(
            f"layer {layer!r}: plan tensor {place.tensor_index} of {tensor.size} bytes is not "
            f"num_blocks={num_blocks} pages of {page} bytes"
        )
    return num_blocks


def _is_padded(spec: KVCacheSpec) -> bool:
    return isinstance(spec, AttentionSpec) and spec.page_size_bytes != _attention_page_bytes(spec)


def _restride_block_major(view: torch.Tensor) -> torch.Tensor:
    """A K/V-first view whose block ``b`` is contiguous: ``[K_b | V_b]`` (hybrid models)."""
    hidden = prod(view.shape[2:])
    return torch.as_strided(
        view, view.shape, (hidden, 2 * hidden, *view.stride()[2:]), view.storage_offset()
    )


def _restride_onto_kv_first(layer: str, view: torch.Tensor) -> torch.Tensor:
    """A blocks-first view addressing K/V-first storage: K of all blocks, then V."""
    if view.dim() < 3 or view.shape[1] != 2:
        raise AllocationError(
            f"layer {layer!r}: only K/V-pair views can share a tensor with K/V-first views"
        )
    half = prod(view.shape[2:])
    assert view.stride()[1] == half, "the K/V stride of a blocks-first view is half a page"
    return torch.as_strided(
        view,
        view.shape,
        (half, view.shape[0] * half, *view.stride()[2:]),
        view.storage_offset(),
    )


def _align_shared_views(
    config: KVCacheConfig,
    views: dict[str, KVCacheView],
    layouts: Mapping[str, AttentionLayout],
    placements: Mapping[str, _Placement],
) -> None:
    """Make every view sharing a tensor agree on which bytes a block id owns."""
    if config.has_mamba_layers:
        # Mamba state steps one page per block, so K/V-first views must too.
        for name, layout in layouts.items():
            if layout.kv_first:
                view = views[name]
                assert isinstance(view, torch.Tensor)
                views[name] = _restride_block_major(view)
        return
    by_tensor: dict[int, list[str]] = {}
    for name, place in placements.items():
        if not place.tensor.is_packed and name in layouts:
            by_tensor.setdefault(place.tensor_index, []).append(name)
    for names in by_tensor.values():
        kv_first = [n for n in names if layouts[n].kv_first]
        if not kv_first or len(kv_first) == len(names):
            continue
        padded = [n for n in names if _is_padded(config.layer_spec(n))]
        if padded:
            raise AllocationError(
                f"layer {padded[0]!r} has padded pages and shares a tensor with K/V-first "
                f"layer {kv_first[0]!r}: their blocks would not line up"
            )
        # Keep the K/V-first storage and point the blocks-first views into it.
        for name in names:
            if not layouts[name].kv_first:
                view = views[name]
                assert isinstance(view, torch.Tensor)
                views[name] = _restride_onto_kv_first(name, view)


def reshape_kv_cache(
    config: KVCacheConfig,
    raw: Mapping[str, torch.Tensor],
    *,
    layouts: Mapping[str, str] | None = None,
    default_layout: str = DEFAULT_LAYOUT,
    shared_layers: Mapping[str, str] | None = None,
    kernel_block_sizes: Mapping[str, int] | None = None,
) -> dict[str, KVCacheView]:
    """The per-layer views of the raw tensors, in each layer's backend layout.

    Args:
        config: the plan the raw tensors were allocated from.
        raw: :func:`allocate_kv_cache`'s result.
        layouts: layout name per attention layer (see :mod:`kvsvc.worker.layouts`); others
            get ``default_layout``. MLA layers always get ``mla``.
        shared_layers: ``{layer: target}`` for layers that reuse another layer's cache
            (not in the plan); each gets its target's view object.
        kernel_block_sizes: per attention layer, the block size the kernel indexes when it
            is smaller than the plan's (a plan block becomes several kernel blocks).

    Returns:
        ``{layer_name: tensor}`` for attention layers, ``{layer_name: [state tensors]}``
        for Mamba layers, plus every shared layer.

    Raises:
        AllocationError: the plan does not fit the layouts (sizes, padding, packing).
        InvalidArgument: a bad layout name, kernel block size or shared-layer target.
    """
    placements = _placements(config)
    missing_raw = [name for name in placements if name not in raw]
    if missing_raw:
        raise AllocationError(f"no raw tensor for layer(s) {', '.join(missing_raw)}")
    layouts = dict(layouts or {})
    unknown = [name for name in layouts if name not in placements]
    if unknown:
        raise InvalidArgument(f"attn_layout[{unknown[0]}]", "no planned layer of that name")
    kernel_block_sizes = kernel_block_sizes or {}
    views: dict[str, KVCacheView] = {}
    resolved: dict[str, AttentionLayout] = {}
    for name, place in placements.items():
        spec = config.layer_spec(name)
        num_blocks = _blocks_in(name, place, spec, config.num_blocks)
        packing = None
        if place.tensor.is_packed:
            packing = (place.tensor.offset, place.tensor.block_stride)
        if isinstance(spec, MambaSpec):
            if name in layouts:
                raise InvalidArgument(f"attn_layout[{name}]", "Mamba layers have no layout")
            views[name] = _mamba_views(name, raw[name], spec, num_blocks, packing)
        elif isinstance(spec, AttentionSpec):
            layout = layout_for(name, spec, layouts.get(name), default_layout)
            resolved[name] = layout
            views[name] = _attention_view(
                name, raw[name], spec, layout, num_blocks, packing, kernel_block_sizes.get(name)
            )
        else:
            raise AllocationError(f"layer {name!r}: no view for {type(spec).__name__}")
    _align_shared_views(config, views, resolved, placements)
    for name, target in (shared_layers or {}).items():
        if name in placements:
            raise InvalidArgument(
                f"shared_layers[{name}]", "the layer has its own cache in the plan"
            )
        if target not in views:
            raise InvalidArgument(
                f"shared_layers[{name}]", f"target {target!r} is not a planned layer"
            )
        views[name] = views[target]
    return views


@dataclass(frozen=True, slots=True)
class ViewInfo:
    """The shape, stride and dtype of one view (what the worker reports to the server)."""

    layer_name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


def describe_views(
    views: Mapping[str, KVCacheView], layers: Sequence[str] | None = None
) -> list[ViewInfo]:
    """One :class:`ViewInfo` per tensor of ``layers`` (default: all), Mamba states in order."""
    out = []
    for name in layers if layers is not None else list(views):
        view = views[name]
        for tensor in view if isinstance(view, list) else [view]:
            shape, stride = tuple(tensor.shape), tuple(tensor.stride())
            out.append(ViewInfo(name, shape, stride, dtype_name(tensor.dtype)))
    return out
