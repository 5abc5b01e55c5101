"""Protobuf <-> domain conversion for specs and plans, in one place.

Every spec kind maps to one arm of the ``KVCacheSpec.spec`` oneof; optional proto fields
carry the ``None`` defaults of the dataclasses, so the round trip is lossless (a test
proves it for every kind). Malformed messages raise :class:`kvsvc.errors.InvalidArgument`
naming the field, so the server can answer INVALID_ARGUMENT without a traceback.
"""

from __future__ import annotations

from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    canonical_dtype,
)
from kvsvc.v1 import specs_pb2 as pb

# Domain quant mode <-> wire enum (the wire reserves 0 for UNSPECIFIED).
_QUANT_TO_PB = {mode: mode.value + 1 for mode in KVQuantMode}
_QUANT_FROM_PB = {value: mode for mode, value in _QUANT_TO_PB.items()}


def _opt(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def _attention_to_pb(spec: AttentionSpec) -> pb.AttentionParams:
    params = pb.AttentionParams(
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=spec.dtype,
        kv_quant_mode=_QUANT_TO_PB[spec.kv_quant_mode],  # type: ignore[arg-type]
        indexes_kv_by_block_stride=spec.indexes_kv_by_block_stride,
    )
    if spec.page_size_padded is not None:
        params.page_size_padded = spec.page_size_padded
    return params


def _attention_kwargs(params: pb.AttentionParams, where: str) -> dict[str, Any]:
    if params.num_kv_heads <= 0:
        raise InvalidArgument(f"{where}.num_kv_heads", "must be positive")
    if params.head_size <= 0:
        raise InvalidArgument(f"{where}.head_size", "must be positive")
    try:
        dtype = canonical_dtype(params.dtype)
    except ValueError as exc:
        raise InvalidArgument(f"{where}.dtype", str(exc)) from None
    if params.kv_quant_mode == 0:
        quant = KVQuantMode.NONE
    elif params.kv_quant_mode in _QUANT_FROM_PB:
        quant = _QUANT_FROM_PB[params.kv_quant_mode]
    else:
        raise InvalidArgument(f"{where}.kv_quant_mode", f"unknown value {params.kv_quant_mode}")
    return {
        "num_kv_heads": params.num_kv_heads,
        "head_size": params.head_size,
        "dtype": dtype,
        "kv_quant_mode": quant,
        "page_size_padded": _opt(params, "page_size_padded"),
        "indexes_kv_by_block_stride": params.indexes_kv_by_block_stride,
    }


def _full_to_pb(spec: FullAttentionSpec) -> pb.FullAttentionSpec:
    msg = pb.FullAttentionSpec(attention=_attention_to_pb(spec), non_causal=spec.non_causal)
    msg.head_size_v = spec.head_size_v
    if spec.sliding_window is not None:
        msg.sliding_window = spec.sliding_window
    if spec.attention_chunk_size is not None:
        msg.attention_chunk_size = spec.attention_chunk_size
    return msg


def _full_kwargs(msg: pb.FullAttentionSpec, where: str) -> dict[str, Any]:
    return {
        **_attention_kwargs(msg.attention, f"{where}.attention"),
        "head_size_v": _opt(msg, "head_size_v"),
        "sliding_window": _opt(msg, "sliding_window"),
        "attention_chunk_size": _opt(msg, "attention_chunk_size"),
        "non_causal": msg.non_causal,
    }


def _mla_to_pb(spec: MLAAttentionSpec) -> pb.MLAAttentionSpec:
    msg = pb.MLAAttentionSpec(
        attention=_attention_to_pb(spec),
        compress_ratio=spec.compress_ratio,
        non_causal=spec.non_causal,
    )
    msg.head_size_v = spec.head_size_v
    for name in ("cache_dtype_str", "alignment", "model_version"):
        value = getattr(spec, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def _mla_kwargs(msg: pb.MLAAttentionSpec, where: str) -> dict[str, Any]:
    return {
        **_attention_kwargs(msg.attention, f"{where}.attention"),
        "head_size_v": _opt(msg, "head_size_v"),
        "cache_dtype_str": _opt(msg, "cache_dtype_str"),
        "alignment": _opt(msg, "alignment"),
        "compress_ratio": msg.compress_ratio or 1,
        "model_version": _opt(msg, "model_version"),
        "non_causal": msg.non_causal,
    }


def spec_to_pb(spec: KVCacheSpec) -> pb.KVCacheSpec:
    """The wire form of a spec (any kind, including uniform-type bundles)."""
    msg = pb.KVCacheSpec(block_size=spec.block_size)
    # Subclasses before their bases: a hidden-state spec is also an MLA spec.
    if isinstance(spec, HiddenStateCacheSpec):
        msg.hidden_state.CopyFrom(_mla_to_pb(spec))
    elif isinstance(spec, MLAAttentionSpec):
        msg.mla_attention.CopyFrom(_mla_to_pb(spec))
    elif isinstance(spec, SinkFullAttentionSpec):
        sink = msg.sink_full_attention
        sink.full.CopyFrom(_full_to_pb(spec))
        if spec.sink_len is not None:
            sink.sink_len = spec.sink_len
    elif isinstance(spec, FullAttentionSpec):
        msg.full_attention.CopyFrom(_full_to_pb(spec))
    elif isinstance(spec, SlidingWindowMLASpec):
        swm = msg.sliding_window_mla
        swm.attention.CopyFrom(_attention_to_pb(spec))
        swm.sliding_window = spec.sliding_window
        swm.compress_ratio = spec.compress_ratio
        for name in ("cache_dtype_str", "alignment", "model_version"):
            value = getattr(spec, name)
            if value is not None:
                setattr(swm, name, value)
    elif isinstance(spec, SlidingWindowSpec):
        sw = msg.sliding_window
        sw.attention.CopyFrom(_attention_to_pb(spec))
        sw.sliding_window = spec.sliding_window
        sw.head_size_v = spec.head_size_v
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        chunked = msg.chunked_local_attention
        chunked.attention.CopyFrom(_attention_to_pb(spec))
        chunked.attention_chunk_size = spec.attention_chunk_size
    elif isinstance(spec, MambaSpec):
        mamba = msg.mamba
        for shape in spec.shapes:
            mamba.shapes.add().dims.extend(shape)
        mamba.dtypes.extend(spec.dtypes)
        if spec.page_size_padded is not None:
            mamba.page_size_padded = spec.page_size_padded
        mamba.mamba_type = spec.mamba_type
        mamba.mamba_cache_mode = spec.mamba_cache_mode
        mamba.num_speculative_blocks = spec.num_speculative_blocks
    elif isinstance(spec, EncoderOnlyAttentionSpec):
        msg.encoder_only_attention.CopyFrom(_attention_to_pb(spec))
    elif isinstance(spec, CrossAttentionSpec):
        msg.cross_attention.CopyFrom(_attention_to_pb(spec))
    elif isinstance(spec, UniformTypeKVCacheSpecs):
        msg.uniform_type.specs.extend(layer_specs_to_pb(spec.kv_cache_specs))
    else:
        raise TypeError(f"no wire form for spec type {type(spec).__name__}")
    return msg


def spec_from_pb(msg: pb.KVCacheSpec, where: str = "spec") -> KVCacheSpec:
    """The domain spec of a wire spec.

    Raises:
        InvalidArgument: naming the field under ``where`` that is missing or invalid.
    """
    if msg.block_size <= 0:
        raise InvalidArgument(f"{where}.block_size", "must be positive")
    arm = msg.WhichOneof("spec")
    if arm is None:
        raise InvalidArgument(f"{where}.spec", "no spec kind set")
    block_size = msg.block_size
    field_where = f"{where}.{arm}"
    try:
        if arm == "full_attention":
            return FullAttentionSpec(
                block_size=block_size, **_full_kwargs(msg.full_attention, field_where)
            )
        if arm == "mla_attention":
            return MLAAttentionSpec(
                block_size=block_size, **_mla_kwargs(msg.mla_attention, field_where)
            )
        if arm == "hidden_state":
            return HiddenStateCacheSpec(
                block_size=block_size, **_mla_kwargs(msg.hidden_state, field_where)
            )
        if arm == "sink_full_attention":
            sink = msg.sink_full_attention
            return SinkFullAttentionSpec(
                block_size=block_size,
                sink_len=_opt(sink, "sink_len"),
                **_full_kwargs(sink.full, f"{field_where}.full"),
            )
        if arm == "sliding_window":
            sw = msg.sliding_window
            return SlidingWindowSpec(
                block_size=block_size,
                sliding_window=sw.sliding_window,
                head_size_v=_opt(sw, "head_size_v"),
                **_attention_kwargs(sw.attention, f"{field_where}.attention"),
            )
        if arm == "sliding_window_mla":
            swm = msg.sliding_window_mla
            return SlidingWindowMLASpec(
                block_size=block_size,
                sliding_window=swm.sliding_window,
                cache_dtype_str=_opt(swm, "cache_dtype_str"),
                alignment=_opt(swm, "alignment"),
                compress_ratio=swm.compress_ratio or 1,
                model_version=_opt(swm, "model_version"),
                **_attention_kwargs(swm.attention, f"{field_where}.attention"),
            )
        if arm == "chunked_local_attention":
            chunked = msg.chunked_local_attention
            if chunked.attention_chunk_size <= 0:
                raise InvalidArgument(f"{field_where}.attention_chunk_size", "must be positive")
            return ChunkedLocalAttentionSpec(
                block_size=block_size,
                attention_chunk_size=chunked.attention_chunk_size,
                **_attention_kwargs(chunked.attention, f"{field_where}.attention"),
            )
        if arm == "mamba":
            mamba = msg.mamba
            try:
                dtypes = tuple(canonical_dtype(d) for d in mamba.dtypes)
            except ValueError as exc:
                raise InvalidArgument(f"{field_where}.dtypes", str(exc)) from None
            return MambaSpec(
                block_size=block_size,
                shapes=tuple(tuple(shape.dims) for shape in mamba.shapes),
                dtypes=dtypes,
                page_size_padded=_opt(mamba, "page_size_padded"),
                mamba_type=mamba.mamba_type or "mamba2",
                mamba_cache_mode=mamba.mamba_cache_mode or "none",
                num_speculative_blocks=mamba.num_speculative_blocks,
            )
        if arm == "encoder_only_attention":
            return EncoderOnlyAttentionSpec(
                block_size=block_size,
                **_attention_kwargs(msg.encoder_only_attention, field_where),
            )
        if arm == "cross_attention":
            return CrossAttentionSpec(
                block_size=block_size, **_attention_kwargs(msg.cross_attention, field_where)
            )
        if arm == "uniform_type":
            if not msg.uniform_type.specs:
                raise InvalidArgument(f"{field_where}.specs", "must not be empty")
            return UniformTypeKVCacheSpecs(
                block_size=block_size,
                kv_cache_specs=layer_specs_from_pb(msg.uniform_type.specs, f"{field_where}.specs"),
            )
    except InvalidArgument:
        raise
    except (ValueError, TypeError) as exc:
        # The dataclasses validate their own invariants (padding, cache modes, ...).
        raise InvalidArgument(field_where, str(exc)) from None
    raise InvalidArgument(f"{where}.spec", f"unsupported spec kind {arm!r}")


def layer_specs_to_pb(specs: dict[str, KVCacheSpec]) -> list[pb.LayerSpec]:
    return [pb.LayerSpec(name=name, spec=spec_to_pb(spec)) for name, spec in specs.items()]


def layer_specs_from_pb(layers: Any, where: str = "layers") -> dict[str, KVCacheSpec]:
    """``{name: spec}`` from repeated LayerSpec, rejecting empty and duplicate names."""
    out: dict[str, KVCacheSpec] = {}
    for i, layer in enumerate(layers):
        if not layer.name:
            raise InvalidArgument(f"{where}[{i}].name", "must not be empty")
        if layer.name in out:
            raise InvalidArgument(f"{where}[{i}].name", f"duplicate layer {layer.name!r}")
        if not layer.HasField("spec"):
            raise InvalidArgument(f"{where}[{i}].spec", "missing")
        out[layer.name] = spec_from_pb(layer.spec, f"{where}[{i}].spec")
    return out


def config_to_pb(config: KVCacheConfig) -> pb.KVCacheConfig:
    return pb.KVCacheConfig(
        num_blocks=config.num_blocks,
        tensors=[
            pb.KVCacheTensor(
                size=t.size, shared_by=t.shared_by, offset=t.offset, block_stride=t.block_stride
            )
            for t in config.kv_cache_tensors
        ],
        groups=[
            pb.KVCacheGroup(
                layer_names=g.layer_names,
                spec=spec_to_pb(g.kv_cache_spec),
                is_eagle_group=g.is_eagle_group,
            )
            for g in config.kv_cache_groups
        ],
    )


def config_from_pb(msg: pb.KVCacheConfig, where: str = "config") -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=msg.num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=t.size,
                shared_by=list(t.shared_by),
                offset=t.offset,
                block_stride=t.block_stride,
            )
            for t in msg.tensors
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names=list(g.layer_names),
                kv_cache_spec=spec_from_pb(g.spec, f"{where}.groups[{i}].spec"),
                is_eagle_group=g.is_eagle_group,
            )
            for i, g in enumerate(msg.groups)
        ],
    )
