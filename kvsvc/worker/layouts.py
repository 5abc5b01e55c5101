"""Per-layer tensor layouts of attention backends, chosen by name.

A plan only says how many bytes each block of a layer takes; the attention backend decides
how those bytes are shaped. A layout is the backend's *logical* shape plus a *stride order*:
the permutation from the logical shape to the order of dimensions in memory (vLLM's
``get_kv_cache_shape`` / ``get_kv_cache_stride_order``). For ``flash_hnd``::

    logical  (num_blocks, 2, block_size, num_kv_heads, head_size)
    order    (0, 1, 3, 2, 4)
    memory   (num_blocks, 2, num_kv_heads, block_size, head_size)

Layouts (``row`` is the bytes one token of one head stores, in elements of the dtype):

    flash         (num_blocks, 2, block_size, heads, row)   blocks-first, NHD
    flash_hnd     (num_blocks, 2, block_size, heads, row)   blocks-first, memory HND
    kv_first      (2, num_blocks, block_size, heads, row)   K of every block, then V
    kv_first_hnd  (2, num_blocks, block_size, heads, row)   same, memory HND
    mla           (num_blocks, block_size, heads * row)      one latent row per token
    diffkv        (num_blocks, block_size, heads, k + v)     K and V of unequal head sizes

MLA layers always use ``mla``; full-attention layers whose value head differs from the key
head always use ``diffkv`` (no K/V-pair shape can hold them). This module is torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from kvsvc.errors import InvalidArgument
from kvsvc.specs import (
    AttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)


class LayoutKind(StrEnum):
    """How a layout splits a page: K/V pairs, one latent row, or K and V side by side."""

    KV_PAIR = "kv_pair"
    MLA = "mla"
    DIFFKV = "diffkv"


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """One backend's logical shape of a layer's cache and its order in memory.

    Attributes:
        name: the name users pick it by (``--attn-layout``).
        kind: how a page is split (see :class:`LayoutKind`).
        kv_first: the K/V dimension comes before the block dimension (``(2, num_blocks,
            ...)``); only for ``KV_PAIR`` layouts.
        stride_order: permutation from the logical shape to memory order.
    """

    name: str
    kind: LayoutKind
    kv_first: bool
    stride_order: tuple[int, ...]

    @property
    def block_dim(self) -> int:
        """Index of the block dimension in the logical shape."""
        return 1 if self.kv_first else 0

    def shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, row: int
    ) -> tuple[int, ...]:
        """The logical shape for ``num_blocks`` blocks of ``block_size`` token slots.

        Args:
            row: elements one token of one head stores (for ``mla``: of all heads; for
                ``diffkv``: K and V together).
        """
        if self.kind is LayoutKind.MLA:
            return (num_blocks, block_size, num_kv_heads * row)
        if self.kind is LayoutKind.DIFFKV:
            return (num_blocks, block_size, num_kv_heads, row)
        if self.kv_first:
            return (2, num_blocks, block_size, num_kv_heads, row)
        return (num_blocks, 2, block_size, num_kv_heads, row)


_NHD = (0, 1, 2, 3, 4)
_HND = (0, 1, 3, 2, 4)

LAYOUTS: dict[str, AttentionLayout] = {
    layout.name: layout
    for layout in (
        AttentionLayout("flash", LayoutKind.KV_PAIR, False, _NHD),
        AttentionLayout("flash_hnd", LayoutKind.KV_PAIR, False, _HND),
        AttentionLayout("kv_first", LayoutKind.KV_PAIR, True, _NHD),
        AttentionLayout("kv_first_hnd", LayoutKind.KV_PAIR, True, _HND),
        AttentionLayout("mla", LayoutKind.MLA, False, (0, 1, 2)),
        AttentionLayout("diffkv", LayoutKind.DIFFKV, False, (0, 1, 2, 3)),
    )
}

DEFAULT_LAYOUT = "flash"


def get_layout(name: str, *, field: str = "attn_layout") -> AttentionLayout:
    """The layout called ``name``.

    Raises:
        InvalidArgument: naming ``field`` and listing the valid names.
    """
    try:
        return LAYOUTS[name]
    except KeyError:
        valid = ", ".join(LAYOUTS)
        raise InvalidArgument(field, f"unknown layout {name!r}; valid layouts: {valid}") from None


def is_mla(spec: KVCacheSpec) -> bool:
    return isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec)


def has_unequal_kv_heads(spec: KVCacheSpec) -> bool:
    head_size_v = getattr(spec, "head_size_v", None)
    return (
        isinstance(spec, AttentionSpec)
        and not is_mla(spec)
        and head_size_v is not None
        and head_size_v != spec.head_size
    )


def layout_for(
    layer_name: str, spec: KVCacheSpec, requested: str | None, default: str = DEFAULT_LAYOUT
) -> AttentionLayout:
    """The layout a layer's view gets.

    Args:
        requested: the layout asked for this layer, if any (else ``default`` applies).

    Raises:
        InvalidArgument: for an unknown name, for asking a non-MLA layout of an MLA layer
            (or ``mla`` of a non-MLA one), or a K/V-pair layout of a layer whose K and V
            head sizes differ.
    """
    field = f"attn_layout[{layer_name}]"
    if not isinstance(spec, AttentionSpec):
        raise InvalidArgument(field, f"layer is {type(spec).__name__}, not an attention layer")
    if is_mla(spec):
        if requested not in (None, "mla"):
            raise InvalidArgument(field, f"MLA layers use the 'mla' layout, not {requested!r}")
        return LAYOUTS["mla"]
    if has_unequal_kv_heads(spec):
        if requested not in (None, "diffkv"):
            raise InvalidArgument(
                field,
                f"K and V head sizes differ ({spec.head_size} vs "
                f"{getattr(spec, 'head_size_v', None)}): only the 'diffkv' layout holds them, "
                f"not {requested!r}",
            )
        return LAYOUTS["diffkv"]
    layout = get_layout(requested or default, field=field)
    if layout.kind is not LayoutKind.KV_PAIR:
        raise InvalidArgument(
            field,
            f"layout {layout.name!r} is not for a layer with equal K and V heads; use one of "
            + ", ".join(n for n, lay in LAYOUTS.items() if lay.kind is LayoutKind.KV_PAIR),
        )
    return layout


def _per_layer_specs(specs: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    out: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        if isinstance(spec, UniformTypeKVCacheSpecs):
            out.update(spec.kv_cache_specs)
        else:
            out[name] = spec
    return out


def resolve_layouts(
    specs: Mapping[str, KVCacheSpec],
    requested: Mapping[str, str] | None = None,
    default: str = DEFAULT_LAYOUT,
) -> dict[str, AttentionLayout]:
    """The layout of every attention layer in ``specs`` (Mamba layers have none).

    Raises:
        InvalidArgument: for a layout named for an unknown layer or a Mamba layer, and for
            every case :func:`layout_for` rejects.
    """
    requested = dict(requested or {})
    per_layer = _per_layer_specs(specs)
    get_layout(default, field="default_attn_layout")
    for name in requested:
        if name not in per_layer:
            raise InvalidArgument(f"attn_layout[{name}]", "no layer of that name")
        if isinstance(per_layer[name], MambaSpec):
            raise InvalidArgument(f"attn_layout[{name}]", "Mamba layers have no attention layout")
    return {
        name: layout_for(name, spec, requested.get(name), default)
        for name, spec in per_layer.items()
        if not isinstance(spec, MambaSpec)
    }
