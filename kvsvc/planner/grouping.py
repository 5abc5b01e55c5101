"""Grouping layers into KV cache groups: the layers that share one block table.

A group is what the block manager allocates for: every layer in it gets the same block
ids. Layers with the same spec (and so the same number of token slots per request) can
share a table; layers of different attention types cannot (a sliding-window layer frees
blocks a full-attention layer keeps). Groups also share *memory*: block id ``b`` is owned
by one group at a time, so the i-th layer of every group can live in the same tensor, as
long as all groups hold the same bytes per block. Hence the rules below, which follow
vLLM's ``get_kv_cache_groups`` step by step:

1. one spec for every layer -> one group;
2. one attention *type* (same token slots) with different page sizes -> one group of a
   :class:`~kvsvc.specs.UniformTypeKVCacheSpecs`;
3. otherwise a hybrid model: pages are brought to one size (scale the block size of the
   smaller pages, or pad them), then layers of each type are split into groups of equal
   size, striped so pipeline stages stay balanced, with padding where the counts differ;
4. with the block-outer layout, pages may keep different sizes and pack side by side in
   a block instead (``packed`` groups);
5. hidden-state layers (hidden-state extraction) get a group each, with a page padded to
   the common page;
6. when pages cannot be unified (MLA next to an incompatible sliding-window draft), local
   attention is allocated as full attention in one group (the full-allocation fallback).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any, TypeVar

from kvsvc.errors import PlanningError
from kvsvc.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    dtype_size,
    merge_layer_specs,
)

logger = logging.getLogger(__name__)

_SpecT = TypeVar("_SpecT", bound=KVCacheSpec)


class PageSizeUnificationError(PlanningError):
    """Layer pages cannot be brought to one size for a layer-outer plan."""


def create_kv_cache_group_specs(
    specs: dict[str, KVCacheSpec], grouped_layer_names: Sequence[Sequence[str]]
) -> list[KVCacheGroupSpec]:
    """One group per name list, with the merged spec of its layers.

    Raises:
        SpecMergeError: naming the layers of a group that disagree.
    """
    groups = []
    for names in grouped_layer_names:
        merged = merge_layer_specs({name: specs[name] for name in names})
        groups.append(KVCacheGroupSpec(list(names), merged))
    return groups


def is_kv_cache_spec_uniform(specs: dict[str, KVCacheSpec]) -> bool:
    """Whether all layers merge into one spec (full attention with and without a recorded
    sliding window counts as one). No layers at all counts as uniform."""
    if not specs:
        return True
    try:
        merge_layer_specs(specs)
    except ValueError:
        return False
    return True


def get_uniform_page_size(specs: Sequence[KVCacheSpec]) -> int:
    page_sizes = {spec.page_size_bytes for spec in specs}
    assert len(page_sizes) == 1, f"expected one page size, got {sorted(page_sizes)}"
    return page_sizes.pop()


def unify_kv_cache_spec_page_size(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Bring every layer's page to the largest page size.

    A smaller attention page whose size divides the largest one scales its block size
    (more tokens per block, same bytes per token); one that does not divide it is padded
    (read through a strided view). Mamba pages do not depend on the block size and are
    always padded. MLA pages are read in whole token rows and can only be padded by their
    own alignment, so an MLA page that does not divide the largest page cannot be unified.

    Raises:
        PageSizeUnificationError: naming the layer that cannot be unified.
    """
    page_sizes = {spec.page_size_bytes for spec in specs.values()}
    if len(page_sizes) <= 1:
        return specs
    max_page = max(page_sizes)
    unified: dict[str, KVCacheSpec] = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        new_spec: KVCacheSpec
        if page == max_page:
            new_spec = spec
        elif isinstance(spec, MambaSpec):
            new_spec = replace(spec, page_size_padded=max_page)
        elif max_page % page == 0:
            block_size = spec.block_size * (max_page // page)
            if isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec):
                # Only MLA's own alignment may pad it: recompute that for the new block.
                new_spec = replace(spec, block_size=block_size, page_size_padded=None)
            elif isinstance(spec, AttentionSpec) and spec.page_size_padded is not None:
                # A padded page grows with the block: pad it to the new page exactly.
                new_spec = replace(spec, block_size=block_size, page_size_padded=max_page)
            else:
                new_spec = spec.copy_with_new_block_size(block_size)
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new_spec = replace(spec, page_size_padded=max_page)
        else:
            raise PageSizeUnificationError(
                f"layer {name}: its page ({page} bytes) does not divide the largest page "
                f"({max_page} bytes) and a {type(spec).__name__} page cannot be padded"
            )
        if new_spec.page_size_bytes != max_page:
            # An MLA page with its own alignment padding can miss the target after scaling.
            raise PageSizeUnificationError(
                f"layer {name}: scaling its block to {new_spec.block_size} tokens gives a "
                f"{new_spec.page_size_bytes}-byte page, not the common {max_page} bytes"
            )
        unified[name] = new_spec
    return unified


def _replace_as(spec: KVCacheSpec, target: type[_SpecT], **changes: Any) -> _SpecT:
    """Rebuild ``spec`` as ``target`` (a sliding-window layer as full attention, ...)."""
    kwargs = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    kwargs.update(changes)
    target_fields = {f.name for f in fields(target)}
    assert set(kwargs) <= target_fields, set(kwargs) - target_fields
    return target(**kwargs)


_PROMOTIONS: dict[type[AttentionSpec], type[AttentionSpec]] = {
    SlidingWindowMLASpec: MLAAttentionSpec,
    SlidingWindowSpec: FullAttentionSpec,
    ChunkedLocalAttentionSpec: FullAttentionSpec,
}


def _promotion_target(spec: KVCacheSpec) -> type[AttentionSpec] | None:
    for cls in type(spec).__mro__:
        if cls in _PROMOTIONS:
            return _PROMOTIONS[cls]
    return None


def promote_local_kv_cache_specs(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Allocate local-attention layers (sliding window, chunked local) as full attention.

    Only the allocation changes: the promoted spec records its window, and the attention
    still computes locally. Done when a model mixes full and local attention and all
    layers must share one block table.

    Raises:
        PlanningError: when the layers still do not form one type afterwards (Mamba, or
            local attention without any full-attention layer).
    """
    promoted = dict(specs)
    if is_kv_cache_spec_uniform(promoted) or UniformTypeKVCacheSpecs.is_uniform_type(promoted):
        return promoted
    values = list(promoted.values())
    has_full = any(isinstance(s, FullAttentionSpec) for s in values)
    has_local = any(isinstance(s, SlidingWindowSpec | ChunkedLocalAttentionSpec) for s in values)
    full_block_sizes = {s.block_size for s in values if isinstance(s, FullAttentionSpec)}
    full_block_size = next(iter(full_block_sizes)) if len(full_block_sizes) == 1 else None
    if has_full and has_local:
        for name, spec in specs.items():
            target = _promotion_target(spec)
            if target is None:
                continue
            assert isinstance(spec, AttentionSpec)
            block_size = full_block_size or spec.block_size
            padded = spec.page_size_padded
            if padded is not None:
                padded = max(padded, spec.unpadded_page_size_bytes * block_size // spec.block_size)
            promoted[name] = _replace_as(
                spec, target, block_size=block_size, page_size_padded=padded
            )
    if not (
        is_kv_cache_spec_uniform(promoted) or UniformTypeKVCacheSpecs.is_uniform_type(promoted)
    ):
        kinds = sorted({str(s.kind) for s in promoted.values()})
        raise PlanningError(
            "the hybrid KV cache manager is disabled, so every layer must share one block "
            f"table, but this model's layers ({', '.join(kinds)}) cannot be allocated as one "
            "type; enable the hybrid KV cache manager"
        )
    return promoted


def unify_hybrid_kv_cache_specs(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Specs for ``disable_hybrid_kv_cache_manager``: local attention promoted to full."""
    promoted = promote_local_kv_cache_specs(specs)
    if promoted != specs:
        logger.info(
            "hybrid KV cache manager disabled: local-attention layers are allocated as full "
            "attention (no memory saved outside their windows; their compute is unchanged)"
        )
    return promoted


def _groups_uniform_page_size(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Groups for a hybrid model whose layers all have one page size.

    Layers are bucketed by mergeable spec; each bucket is split into groups of
    ``group_size`` layers (the smallest bucket, or the largest when the buckets are within
    1.5x of each other, to avoid padding a near-equal split). E.g. 10 full + 20 sliding
    -> (10 full), (10 sliding), (10 sliding). Layer ``i`` of a bucket goes to group
    ``i % num_groups`` (striping), so a pipeline stage holding a contiguous run of layers
    gets about as many layers of every group, instead of whole groups landing on one stage
    and empty ones (pure padding) on another.
    """
    same_spec: dict[KVCacheSpec, list[str]] = defaultdict(list)
    for name, spec in specs.items():
        same_spec[spec].append(name)

    # Merge buckets whose specs reconcile (full attention differing only in a recorded
    # sliding window / chunk size), to keep the group count down.
    name_buckets: list[list[str]] = []
    spec_buckets: list[list[KVCacheSpec]] = []
    for spec, names in same_spec.items():
        for bucket_names, bucket_specs in zip(name_buckets, spec_buckets, strict=True):
            try:
                type(bucket_specs[0]).merge([*bucket_specs, spec])
            except ValueError:
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            break
        else:
            name_buckets.append(list(names))
            spec_buckets.append([spec])

    min_layers = min(len(names) for names in name_buckets)
    max_layers = max(len(names) for names in name_buckets)
    group_size = max_layers if max_layers < min_layers * 1.5 else min_layers
    grouped: list[list[str]] = []
    for names in name_buckets:
        padding = -len(names) % group_size
        if padding:
            logger.info(
                "KV cache grouping adds %d padding layer(s) to a bucket of %d (up to %.1f%% of "
                "its memory unused)",
                padding,
                len(names),
                100 * padding / len(names),
            )
        num_groups = cdiv(len(names), group_size)
        grouped.extend(names[i::num_groups] for i in range(num_groups))
    return create_kv_cache_group_specs(specs, grouped)


def approximate_gcd(values: Sequence[int], *, lower_bound: int | None = None) -> int:
    """The chunk ``d >= lower_bound`` that wastes the least when every value is rounded up
    to a multiple of it (ties: the larger ``d``). Brute force; the values are layer counts.
    """
    if not values:
        raise ValueError("values must be non-empty")
    if any(v <= 0 for v in values):
        raise ValueError(f"values must be positive, got {list(values)!r}")
    low = max(1, lower_bound or 1)
    high = max(values)
    if low > high:
        return low
    best_d, best_pad = low, None
    for d in range(low, high + 1):
        pad = sum(-v % d for v in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best_d):
            best_d, best_pad = d, pad
    return best_d


def _packed_groups(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec] | None:
    """Groups for mixed page sizes packed block-outermost (one backing, pages side by side).

    Layers are bucketed greedily by uniform type. A bucket whose page sizes come in equal
    counts is a repeating pattern (one layer of each page size per repeat) and is split
    into groups of the same number of repeats, chosen by :func:`approximate_gcd` to pad the
    least, so every group packs into the same block layout. State buckets (Mamba, and
    sliding windows when nothing repeats) are split further so they fit the block the
    other buckets already need. None when all pages are equal (nothing to pack).
    """
    if len({spec.page_size_bytes for spec in specs.values()}) <= 1:
        return None

    buckets: list[dict[str, KVCacheSpec]] = []
    for name, spec in specs.items():
        for bucket in buckets:
            if UniformTypeKVCacheSpecs.is_uniform_type({**bucket, name: spec}):
                bucket[name] = spec
                break
        else:
            buckets.append({name: spec})

    bucketed: list[tuple[UniformTypeKVCacheSpecs, dict[int, list[str]], bool]] = []
    for bucket in buckets:
        uniform = UniformTypeKVCacheSpecs.from_specs(bucket)
        assert uniform is not None
        by_page: dict[int, list[str]] = defaultdict(list)
        for name, spec in bucket.items():
            by_page[spec.page_size_bytes].append(name)
        balanced = len({len(names) for names in by_page.values()}) == 1
        bucketed.append((uniform, by_page, balanced))

    # A balanced bucket mixing page sizes must stay whole per repeat, so the largest sets a
    # floor on the repeats per group; larger single-size buckets are split towards it.
    min_repeats = max(
        (
            u.get_max_layers_per_page_size()
            for u, by_page, balanced in bucketed
            if balanced and len(by_page) > 1
        ),
        default=0,
    )
    repeats_per_group = (
        approximate_gcd(
            [u.get_max_layers_per_page_size() for u, _, balanced in bucketed if balanced],
            lower_bound=min_repeats,
        )
        if min_repeats
        else None
    )

    def num_groups_for(uniform: UniformTypeKVCacheSpecs, balanced: bool) -> int:
        if balanced and repeats_per_group is not None:
            return cdiv(uniform.get_max_layers_per_page_size(), repeats_per_group)
        return 1

    def widest_group_bytes(by_page: dict[int, list[str]], n: int) -> int:
        return sum(cdiv(len(names), n) * page for page, names in by_page.items())

    def is_state_bucket(uniform: UniformTypeKVCacheSpecs) -> bool:
        if isinstance(uniform.first_spec, MambaSpec):
            return True
        return repeats_per_group is None and isinstance(uniform.first_spec, SlidingWindowSpec)

    anchor_bytes = max(
        (
            widest_group_bytes(
                by_page,
                len(u.kv_cache_specs) if is_state_bucket(u) else num_groups_for(u, balanced),
            )
            for u, by_page, balanced in bucketed
        ),
        default=0,
    )

    groups: list[KVCacheGroupSpec] = []
    for uniform, by_page, balanced in bucketed:
        num_groups = num_groups_for(uniform, balanced)
        if anchor_bytes and is_state_bucket(uniform):
            # Cap a state group at the states one block already fits, rather than let it
            # widen the block.
            states_per_block = max(anchor_bytes // uniform.first_spec.page_size_bytes, 1)
            num_groups = max(num_groups, cdiv(len(uniform.kv_cache_specs), states_per_block))
        if num_groups == 1:
            groups.append(KVCacheGroupSpec(list(uniform.kv_cache_specs), uniform))
            continue
        if balanced:
            repeats = list(zip(*by_page.values(), strict=True))
            layer_lists = [
                [name for repeat in repeats[i::num_groups] for name in repeat]
                for i in range(num_groups)
            ]
        else:
            # No repeating pattern to keep whole: stripe the layers themselves.
            names = list(uniform.kv_cache_specs)
            layer_lists = [names[i::num_groups] for i in range(num_groups)]
        for layer_names in layer_lists:
            if not layer_names:
                continue
            group_spec = UniformTypeKVCacheSpecs.from_specs(
                {name: uniform.kv_cache_specs[name] for name in layer_names}
            )
            assert group_spec is not None
            groups.append(KVCacheGroupSpec(layer_names, group_spec))
    return groups


def _full_allocation_fallback_groups(
    specs: dict[str, KVCacheSpec],
) -> list[KVCacheGroupSpec] | None:
    """One full-allocation group for MLA next to regular sliding-window layers whose pages
    cannot be unified (e.g. an MLA target with a sliding-window draft); None otherwise."""
    values = list(specs.values())
    if any(isinstance(s, HiddenStateCacheSpec) for s in values):
        return None
    if any(isinstance(s, SlidingWindowMLASpec | ChunkedLocalAttentionSpec) for s in values):
        return None
    has_mla = any(isinstance(s, MLAAttentionSpec) for s in values)
    has_swa = any(isinstance(s, SlidingWindowSpec) for s in values)
    if not (has_mla and has_swa):
        return None
    try:
        promoted = promote_local_kv_cache_specs(specs)
    except PlanningError:
        return None
    uniform = UniformTypeKVCacheSpecs.from_specs(promoted)
    if uniform is None:
        return None
    logger.warning(
        "KV cache page sizes cannot be unified; sliding-window layers are allocated as full "
        "attention (their attention compute is unchanged)"
    )
    return [KVCacheGroupSpec(list(uniform.kv_cache_specs), uniform)]


def _largest_divisor_at_most(value: int, limit: int) -> int:
    for candidate in range(min(value, limit), 0, -1):
        if value % candidate == 0:
            return candidate
    return 1


def _hidden_state_bytes_per_token(spec: HiddenStateCacheSpec) -> int:
    return spec.num_kv_heads * spec.head_size * dtype_size(spec.dtype)


def _ensure_min_page_size(
    groups: list[KVCacheGroupSpec], common_page: int, hidden: dict[str, HiddenStateCacheSpec]
) -> tuple[list[KVCacheGroupSpec], int]:
    """Scale every group's block size until the common page holds one token of the widest
    hidden-state layer (TP can shrink attention pages below it)."""
    per_token = max(_hidden_state_bytes_per_token(spec) for spec in hidden.values())
    if per_token <= common_page:
        return groups, common_page
    scale = cdiv(per_token, common_page)
    scaled = []
    for group in groups:
        spec = group.kv_cache_spec
        changes: dict[str, Any] = {"block_size": spec.block_size * scale}
        if isinstance(spec, AttentionSpec | MambaSpec) and spec.page_size_padded is not None:
            changes["page_size_padded"] = spec.page_size_padded * scale
        scaled.append(KVCacheGroupSpec(group.layer_names, replace(spec, **changes)))
    return scaled, common_page * scale


def _add_hidden_state_groups(
    groups: list[KVCacheGroupSpec], hidden: dict[str, HiddenStateCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Give each hidden-state layer a group whose page is padded to the common page.

    Its block size is the largest divisor of the groups' common block size whose tokens
    fit the page, so its blocks still line up with the attention blocks for prefix caching.
    """
    common_page = get_uniform_page_size([g.kv_cache_spec for g in groups])
    groups, common_page = _ensure_min_page_size(groups, common_page, hidden)
    group_block_size = math.gcd(*(g.kv_cache_spec.block_size for g in groups))
    for name, spec in hidden.items():
        per_token = _hidden_state_bytes_per_token(spec)
        block_size = _largest_divisor_at_most(group_block_size, max(common_page // per_token, 1))
        aligned = replace(spec, block_size=block_size, page_size_padded=common_page)
        groups.append(KVCacheGroupSpec([name], aligned))
    return groups


def get_kv_cache_groups(
    specs: dict[str, KVCacheSpec],
    *,
    layout: str = "layer_outer",
    disable_hybrid_kv_cache_manager: bool = False,
) -> list[KVCacheGroupSpec]:
    """Split the model's layers into KV cache groups (see the module docstring).

    Args:
        specs: the spec of every layer of the whole model (all pipeline stages).
        layout: ``block_outer`` lets layers with different page sizes pack side by side.
        disable_hybrid_kv_cache_manager: put every layer in one block table.

    Raises:
        PlanningError: when the layers cannot be grouped; the message says what to change.
    """
    if disable_hybrid_kv_cache_manager:
        specs = unify_hybrid_kv_cache_specs(specs)
    if not specs:
        return []  # attention-free: no KV cache at all
    if is_kv_cache_spec_uniform(specs):
        return create_kv_cache_group_specs(specs, [list(specs)])
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    if uniform is not None:
        return [KVCacheGroupSpec(list(specs), uniform)]

    # Hidden-state layers keep their own block table; they must not join a compatible
    # attention bucket.
    hidden = {n: s for n, s in specs.items() if isinstance(s, HiddenStateCacheSpec)}
    others = {n: s for n, s in specs.items() if not isinstance(s, HiddenStateCacheSpec)}
    if not others:
        return [KVCacheGroupSpec([name], spec) for name, spec in hidden.items()]

    if layout == "block_outer":
        packed = _packed_groups(others)
        if packed is not None:
            # A packed block is as wide as its widest group, so hidden-state groups need
            # no page alignment there.
            return packed + [KVCacheGroupSpec([n], s) for n, s in hidden.items()]

    try:
        others = unify_kv_cache_spec_page_size(others)
    except PageSizeUnificationError as exc:
        fallback = _full_allocation_fallback_groups(specs)
        if fallback is not None:
            return fallback
        if layout == "block_outer":
            raise
        raise PageSizeUnificationError(
            f"{exc}. Layers with pages of different sizes can only share blocks packed side "
            "by side: plan with layout='block_outer' (kvsvc plan --layout block_outer)"
        ) from None
    groups = _groups_uniform_page_size(others)
    if hidden:
        groups = _add_hidden_state_groups(groups, hidden)
    return groups
