"""vLLM's per-layer KV cache specs as kvsvc specs, checked byte for byte.

A vLLM worker describes each layer with a class of ``vllm.v1.kv_cache_interface``; kvsvc's
planner needs the same facts as :mod:`kvsvc.specs` types to plan the pool. The two
hierarchies name the same attention kinds, but vLLM's carries fields kvsvc has no room for
(packed page layouts, replay windows, sparse-indexer roles, ...). A conversion that dropped
one of them silently would make kvsvc plan pages of a different size than vLLM allocates,
so every conversion here

- dispatches on the *exact* vLLM class (a subclass such as ``RSWASpec`` is not "full
  attention" to the block manager, even though it inherits from it),
- refuses a field set to something kvsvc cannot represent, naming the layer and field, and
- compares the page size both sides compute: a spec converts only when kvsvc's page
  arithmetic gives vLLM's bytes.

Anything else raises :class:`UnsupportedSpecError`, which says what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from vllm.v1 import kv_cache_interface as vkv

from kvsvc.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    canonical_dtype,
)


class UnsupportedSpecError(ValueError):
    """A vLLM layer spec kvsvc cannot plan for (its kind, a field, or its page size)."""

    def __init__(self, layer: str, spec: object, reason: str) -> None:
        super().__init__(
            f"kvsvc cannot plan layer {layer!r} ({type(spec).__name__}): {reason}. "
            "Run this model without kvsvc (drop worker_cls/scheduler_cls), or extend "
            "kvsvc.integrations.vllm.specs for it"
        )
        self.layer = layer
        self.spec = spec


def dtype_name(dtype: Any) -> str:
    """kvsvc's canonical name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return canonical_dtype(str(dtype))


def _quant_mode(layer: str, spec: vkv.AttentionSpec) -> KVQuantMode:
    # Same names on both sides for the modes kvsvc sizes; the others (turboquant, ...)
    # have page layouts kvsvc does not model.
    name = spec.kv_quant_mode.name
    if name not in KVQuantMode.__members__:
        raise UnsupportedSpecError(layer, spec, f"KV quantisation mode {name} is not supported")
    return KVQuantMode[name]


def _require(layer: str, spec: object, field: str, value: Any, allowed: Any) -> None:
    if value != allowed:
        raise UnsupportedSpecError(
            layer, spec, f"{field}={value!r} is not supported (only {allowed!r})"
        )


def _attention_kwargs(layer: str, spec: vkv.AttentionSpec) -> dict[str, Any]:
    """The fields every kvsvc attention spec takes, from vLLM's common attention fields."""
    try:
        dtype = dtype_name(spec.dtype)
    except ValueError as exc:
        raise UnsupportedSpecError(layer, spec, str(exc)) from None
    return {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": dtype,
        "kv_quant_mode": _quant_mode(layer, spec),
        "page_size_padded": spec.page_size_padded,
    }


def _one_token_per_state(layer: str, spec: vkv.AttentionSpec) -> None:
    # Whisper-style block pooling (a fraction) and compressed rows (> 1) change how many
    # token slots a page holds; only MLA models compression in kvsvc.
    _require(layer, spec, "tokens_per_state", spec.tokens_per_state, 1)


def _compress_ratio(layer: str, spec: vkv.AttentionSpec) -> int:
    ratio = spec.tokens_per_state
    if isinstance(ratio, Fraction) and ratio.denominator == 1:
        ratio = int(ratio)
    if not isinstance(ratio, int) or ratio < 1:
        raise UnsupportedSpecError(
            layer, spec, f"tokens_per_state={ratio!r} is not a whole compression ratio"
        )
    return ratio


def _full_kwargs(layer: str, spec: vkv.FullAttentionSpec) -> dict[str, Any]:
    _one_token_per_state(layer, spec)
    return {
        **_attention_kwargs(layer, spec),
        "head_size_v": spec.head_size_v,
        "sliding_window": spec.sliding_window,
        "attention_chunk_size": spec.attention_chunk_size,
        "non_causal": spec.non_causal,
    }


def _full(layer: str, spec: vkv.FullAttentionSpec) -> FullAttentionSpec:
    return FullAttentionSpec(**_full_kwargs(layer, spec))


def _sink_full(layer: str, spec: vkv.SinkFullAttentionSpec) -> SinkFullAttentionSpec:
    return SinkFullAttentionSpec(**_full_kwargs(layer, spec), sink_len=spec.sink_len)


def _mla_kwargs(layer: str, spec: vkv.MLAAttentionSpec) -> dict[str, Any]:
    # The DeepSeek sparse indexer's roles put layers in groups kvsvc's grouping does not
    # know about.
    _require(layer, spec, "cache_role", spec.cache_role, vkv.SparseCacheRole.SPARSE)
    _require(layer, spec, "is_index_group_leader", spec.is_index_group_leader, False)
    return {
        **_attention_kwargs(layer, spec),
        "cache_dtype_str": spec.cache_dtype_str,
        "alignment": spec.alignment,
        "compress_ratio": _compress_ratio(layer, spec),
        "model_version": spec.model_version,
        "non_causal": spec.non_causal,
    }


def _mla(layer: str, spec: vkv.MLAAttentionSpec) -> MLAAttentionSpec:
    return MLAAttentionSpec(**_mla_kwargs(layer, spec))


def _hidden_state(layer: str, spec: vkv.HiddenStateCacheSpec) -> HiddenStateCacheSpec:
    return HiddenStateCacheSpec(**_mla_kwargs(layer, spec))


def _sliding_window(layer: str, spec: vkv.SlidingWindowSpec) -> SlidingWindowSpec:
    _one_token_per_state(layer, spec)
    # The engine core sets extra_retained_tokens for multi-module speculation; a worker's
    # own spec carries 0, and kvsvc sizes windows without it.
    _require(layer, spec, "extra_retained_tokens", spec.extra_retained_tokens, 0)
    return SlidingWindowSpec(
        **_attention_kwargs(layer, spec),
        sliding_window=spec.sliding_window,
        head_size_v=spec.head_size_v,
    )


def _sliding_window_mla(layer: str, spec: vkv.SlidingWindowMLASpec) -> SlidingWindowMLASpec:
    _require(layer, spec, "extra_retained_tokens", spec.extra_retained_tokens, 0)
    # Bounded replay makes the group skip prefix caching; kvsvc's index would cache it.
    _require(layer, spec, "bounded_replay", spec.bounded_replay, False)
    return SlidingWindowMLASpec(
        **_attention_kwargs(layer, spec),
        sliding_window=spec.sliding_window,
        cache_dtype_str=spec.cache_dtype_str,
        alignment=spec.alignment,
        compress_ratio=_compress_ratio(layer, spec),
        model_version=spec.model_version,
    )


def _chunked_local(layer: str, spec: vkv.ChunkedLocalAttentionSpec) -> ChunkedLocalAttentionSpec:
    _one_token_per_state(layer, spec)
    return ChunkedLocalAttentionSpec(
        **_attention_kwargs(layer, spec), attention_chunk_size=spec.attention_chunk_size
    )


def _encoder_only(layer: str, spec: vkv.EncoderOnlyAttentionSpec) -> EncoderOnlyAttentionSpec:
    _one_token_per_state(layer, spec)
    return EncoderOnlyAttentionSpec(**_attention_kwargs(layer, spec))


def _cross(layer: str, spec: vkv.CrossAttentionSpec) -> CrossAttentionSpec:
    _one_token_per_state(layer, spec)
    return CrossAttentionSpec(**_attention_kwargs(layer, spec))


def _mamba(layer: str, spec: vkv.MambaSpec) -> MambaSpec:
    # Prefill checkpoints add state blocks per request that kvsvc does not budget.
    _require(layer, spec, "num_prefill_checkpoint_blocks", spec.num_prefill_checkpoint_blocks, 0)
    try:
        dtypes = tuple(dtype_name(d) for d in spec.dtypes)
    except ValueError as exc:
        raise UnsupportedSpecError(layer, spec, str(exc)) from None
    return MambaSpec(
        block_size=spec.block_size,
        shapes=tuple(tuple(int(d) for d in shape) for shape in spec.shapes),
        dtypes=dtypes,
        page_size_padded=spec.page_size_padded,
        mamba_type=spec.mamba_type.name.lower(),
        mamba_cache_mode=spec.mamba_cache_mode,
        num_speculative_blocks=spec.num_speculative_blocks,
    )


# Exact classes only: a subclass vLLM adds later has its own block-manager semantics.
_CONVERTERS: dict[type, Callable[[str, Any], KVCacheSpec]] = {
    vkv.FullAttentionSpec: _full,
    vkv.SinkFullAttentionSpec: _sink_full,
    vkv.MLAAttentionSpec: _mla,
    vkv.HiddenStateCacheSpec: _hidden_state,
    vkv.SlidingWindowSpec: _sliding_window,
    vkv.SlidingWindowMLASpec: _sliding_window_mla,
    vkv.ChunkedLocalAttentionSpec: _chunked_local,
    vkv.EncoderOnlyAttentionSpec: _encoder_only,
    vkv.CrossAttentionSpec: _cross,
    vkv.MambaSpec: _mamba,
}

SUPPORTED_VLLM_SPECS: tuple[str, ...] = tuple(sorted(cls.__name__ for cls in _CONVERTERS))


def _check_bytes(layer: str, vllm_spec: vkv.KVCacheSpec, spec: KVCacheSpec) -> None:
    """kvsvc must size the page (and the block stride) exactly as vLLM will allocate it."""
    alignment = vllm_spec.get_block_stride_alignment()
    if vllm_spec.page_size_bytes % alignment:
        raise UnsupportedSpecError(
            layer,
            vllm_spec,
            f"its {vllm_spec.page_size_bytes}-byte pages are strided to a multiple of "
            f"{alignment} bytes (block_stride_alignment), which kvsvc does not plan",
        )
    pairs = [("page", vllm_spec.page_size_bytes, spec.page_size_bytes)]
    if isinstance(vllm_spec, vkv.AttentionSpec) and isinstance(spec, AttentionSpec):
        pairs.append(
            ("unpadded page", vllm_spec.unpadded_page_size_bytes, spec.unpadded_page_size_bytes)
        )
    for what, theirs, ours in pairs:
        if theirs != ours:
            raise UnsupportedSpecError(
                layer,
                vllm_spec,
                f"vLLM's {what} is {theirs} bytes but kvsvc computes {ours} bytes for the "
                "same fields (a packed or custom page layout)",
            )


def kvsvc_spec_from_vllm(layer: str, spec: vkv.KVCacheSpec) -> KVCacheSpec:
    """The kvsvc spec of one vLLM layer spec.

    Raises:
        UnsupportedSpecError: the kind, a field or the page size has no kvsvc equivalent.
    """
    converter = _CONVERTERS.get(type(spec))
    if converter is None:
        raise UnsupportedSpecError(
            layer,
            spec,
            "this kind of layer is not supported (supported: "
            + ", ".join(SUPPORTED_VLLM_SPECS)
            + ")",
        )
    try:
        converted = converter(layer, spec)
    except UnsupportedSpecError:
        raise
    except ValueError as exc:  # kvsvc's own validation (padding, compress ratio, ...)
        raise UnsupportedSpecError(layer, spec, str(exc)) from None
    _check_bytes(layer, spec, converted)
    return converted


def kvsvc_specs_from_vllm(specs: Mapping[str, vkv.KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Every layer of a worker (``worker.get_kv_cache_spec()``) as kvsvc specs, in order.

    Raises:
        UnsupportedSpecError: for the first layer that cannot be converted.
    """
    return {layer: kvsvc_spec_from_vllm(layer, spec) for layer, spec in specs.items()}


__all__ = [
    "SUPPORTED_VLLM_SPECS",
    "UnsupportedSpecError",
    "dtype_name",
    "kvsvc_spec_from_vllm",
    "kvsvc_specs_from_vllm",
]
