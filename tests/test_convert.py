"""Specs and plans survive the wire unchanged, and malformed messages name their field."""

from __future__ import annotations

import pytest

from kvsvc.convert import (
    config_from_pb,
    config_to_pb,
    layer_specs_from_pb,
    layer_specs_to_pb,
    spec_from_pb,
    spec_to_pb,
)
from kvsvc.errors import InvalidArgument
from kvsvc.specs import (
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
)
from kvsvc.v1 import specs_pb2 as pb

ATTN = {"num_kv_heads": 8, "head_size": 128, "dtype": "bfloat16"}

EVERY_KIND: list[KVCacheSpec] = [
    FullAttentionSpec(block_size=16, **ATTN),
    FullAttentionSpec(
        block_size=16,
        num_kv_heads=4,
        head_size=192,
        head_size_v=128,
        dtype="float8_e4m3fn",
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        sliding_window=4096,
        non_causal=True,
        page_size_padded=1 << 20,
        indexes_kv_by_block_stride=True,
    ),
    FullAttentionSpec(block_size=32, attention_chunk_size=8192, **ATTN),
    FullAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype="int8",
        kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD,
    ),
    MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16"),
    MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype="uint8",
        cache_dtype_str="fp8_ds_mla",
    ),
    MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=512,
        dtype="uint8",
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
        compress_ratio=4,
        alignment=576,
    ),
    HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=4096, dtype="bfloat16"),
    SinkFullAttentionSpec(block_size=16, sink_len=4, **ATTN),
    SlidingWindowSpec(block_size=16, sliding_window=4096, **ATTN),
    SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16", sliding_window=128
    ),
    ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=8192, **ATTN),
    MambaSpec(
        block_size=16,
        shapes=((4096, 3), (4096, 16)),
        dtypes=("bfloat16", "float32"),
        mamba_type="mamba1",
        mamba_cache_mode="align",
        num_speculative_blocks=2,
        page_size_padded=1 << 20,
    ),
    EncoderOnlyAttentionSpec(block_size=16, **ATTN),
    CrossAttentionSpec(block_size=16, **ATTN),
    UniformTypeKVCacheSpecs(
        block_size=16,
        kv_cache_specs={
            "b.attn": FullAttentionSpec(block_size=16, **ATTN),
            "a.attn": MLAAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16"
            ),
        },
    ),
]


@pytest.mark.parametrize("spec", EVERY_KIND, ids=lambda s: type(s).__name__)
def test_every_spec_kind_round_trips(spec: KVCacheSpec) -> None:
    wire = pb.KVCacheSpec.FromString(spec_to_pb(spec).SerializeToString())
    back = spec_from_pb(wire)
    assert back == spec
    assert type(back) is type(spec)
    assert back.page_size_bytes == spec.page_size_bytes


def test_uniform_type_keeps_layer_order() -> None:
    spec = EVERY_KIND[-1]
    assert isinstance(spec, UniformTypeKVCacheSpecs)
    back = spec_from_pb(spec_to_pb(spec))
    assert isinstance(back, UniformTypeKVCacheSpecs)
    assert list(back.kv_cache_specs) == ["b.attn", "a.attn"]


def test_config_round_trips() -> None:
    spec = FullAttentionSpec(block_size=16, **ATTN)
    config = KVCacheConfig(
        num_blocks=100,
        kv_cache_tensors=[KVCacheTensor(size=100 * spec.page_size_bytes, shared_by=["l0", "l1"])],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec), KVCacheGroupSpec(["l1"], spec, True)],
    )
    assert config_from_pb(config_to_pb(config)) == config


def test_missing_kind_names_the_field() -> None:
    with pytest.raises(InvalidArgument, match=r"layers\[0\]\.spec\.spec: no spec kind set"):
        layer_specs_from_pb([pb.LayerSpec(name="l0", spec=pb.KVCacheSpec(block_size=16))])


def test_bad_values_name_the_field() -> None:
    msg = spec_to_pb(FullAttentionSpec(block_size=16, **ATTN))
    msg.full_attention.attention.dtype = "float7"
    with pytest.raises(InvalidArgument, match=r"full_attention\.attention\.dtype: unknown dtype"):
        spec_from_pb(msg)
    msg = spec_to_pb(FullAttentionSpec(block_size=16, **ATTN))
    msg.block_size = 0
    with pytest.raises(InvalidArgument, match=r"spec\.block_size: must be positive"):
        spec_from_pb(msg)
    msg = spec_to_pb(MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)))
    msg.mamba.mamba_cache_mode = "sometimes"
    with pytest.raises(InvalidArgument, match=r"spec\.mamba: unknown mamba_cache_mode"):
        spec_from_pb(msg)


def test_duplicate_layer_names_are_rejected() -> None:
    layers = layer_specs_to_pb({"l0": FullAttentionSpec(block_size=16, **ATTN)}) * 2
    with pytest.raises(InvalidArgument, match=r"layers\[1\]\.name: duplicate layer 'l0'"):
        layer_specs_from_pb(layers)
