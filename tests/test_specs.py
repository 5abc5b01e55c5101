"""kvsvc.specs: the page arithmetic of every spec kind, quantisation, merges, JSON form.

Expected numbers are derived by hand in the comments: a worker allocates exactly these
bytes, so they must match vLLM's ``kv_cache_interface`` to the byte.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.specs import (
    FP8_DS_MLA_ROW_BYTES_V4,
    FP8_DS_MLA_ROW_BYTES_V32,
    SPEC_TYPES,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheSpecKind,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SizingContext,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
    config_from_dict,
    config_to_dict,
    iter_layer_specs,
    merge_layer_specs,
    nvfp4_full_dim,
    resolve_kv_cache_dtype,
    sliding_window_of,
    spec_from_dict,
    spec_to_dict,
)


def full(**kw: object) -> FullAttentionSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": "float32",
    }
    args.update(kw)
    return FullAttentionSpec(**args)  # type: ignore[arg-type]


def sliding(window: int = 4, **kw: object) -> SlidingWindowSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": "float32",
        "sliding_window": window,
    }
    args.update(kw)
    return SlidingWindowSpec(**args)  # type: ignore[arg-type]


def mla(**kw: object) -> MLAAttentionSpec:
    # head_size = kv_lora_rank (512) + qk_rope_head_dim (64)
    args: dict[str, object] = {
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 576,
        "dtype": "bfloat16",
    }
    args.update(kw)
    return MLAAttentionSpec(**args)  # type: ignore[arg-type]


def mamba(**kw: object) -> MambaSpec:
    args: dict[str, object] = {
        "block_size": 16,
        "shapes": ((2, 512), (3, 32, 32)),
        "dtypes": ("float32", "float32"),
        "num_speculative_blocks": 2,
    }
    args.update(kw)
    return MambaSpec(**args)  # type: ignore[arg-type]


CTX = SizingContext(max_model_len=100, max_num_batched_tokens=2, max_num_encoder_input_tokens=1500)


# ---- full attention -------------------------------------------------------------------


def test_full_attention_page_counts_k_and_v() -> None:
    # 16 tokens * 2 heads * (64 K + 64 V) * 4 bytes
    assert full().page_size_bytes == 16 * 2 * 128 * 4 == 16384
    assert full().head_size_v == 64
    # A narrower V head (MLA-style draft, MiMo): 16 * 2 * (64 + 32) * 4
    assert full(head_size_v=32).page_size_bytes == 12288


def test_full_attention_request_memory_and_block_table_width() -> None:
    # ceil(100 / 16) = 7 pages
    assert full().max_memory_usage_bytes(CTX) == 7 * 16384
    assert full().max_num_blocks_per_req(CTX, 100) == 7
    # DCP over 4 ranks: each keeps ceil(100 / 4) = 25 tokens -> ceil(25 / 16) = 2 pages,
    # and a block-table row spans 16 * 4 tokens -> ceil(100 / 64) = 2 entries.
    dcp = replace(CTX, dcp_world_size=4)
    assert full().max_memory_usage_bytes(dcp) == 2 * 16384
    assert full().max_num_blocks_per_req(dcp, 100) == 2


def test_full_attention_padding_and_its_check() -> None:
    assert full(page_size_padded=20000).page_size_bytes == 20000
    assert full(page_size_padded=20000).real_page_size_bytes == 16384
    with pytest.raises(ValueError, match="smaller than the real page"):
        full(page_size_padded=1000)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected"),
    [
        # fp8 per tensor: 1 byte per element: 16 * 2 * (128 + 128) * 1
        ("fp8", 8192),
        ("fp8_e5m2", 8192),
        # int8 / fp8 per token-head: the same 8192 plus one fp32 scale per token, head and
        # K/V: 2 * 16 * 2 * 4 = 256 bytes
        ("int8_per_token_head", 8192 + 256),
        ("fp8_per_token_head", 8192 + 256),
        # int4: two values a byte, (64 + 64) bytes per token-head, plus the 256 bytes of scales
        ("int4_per_token_head", 16 * 2 * 128 + 256),
        # nvfp4: per head 128 / 2 bytes of data + 128 / 16 fp8 scales = 72, for K and V
        ("nvfp4", 16 * 2 * 144),
        ("auto", 16 * 2 * 256 * 2),
    ],
)
def test_quantisation_modes_change_the_page(kv_cache_dtype: str, expected: int) -> None:
    dtype, mode = resolve_kv_cache_dtype(kv_cache_dtype, "bfloat16")
    spec = full(head_size=128, dtype=dtype, kv_quant_mode=mode)
    assert spec.page_size_bytes == expected


def test_resolve_kv_cache_dtype() -> None:
    assert resolve_kv_cache_dtype("auto", "bf16") == ("bfloat16", KVQuantMode.NONE)
    assert resolve_kv_cache_dtype("fp8", "bfloat16") == (
        "float8_e4m3fn",
        KVQuantMode.FP8_PER_TENSOR,
    )
    assert resolve_kv_cache_dtype("int8_per_token_head", "bfloat16") == (
        "int8",
        KVQuantMode.INT8_PER_TOKEN_HEAD,
    )
    assert nvfp4_full_dim(128) == 72
    with pytest.raises(ValueError, match="valid values"):
        resolve_kv_cache_dtype("fp7", "bfloat16")


# ---- MLA ------------------------------------------------------------------------------


def test_mla_page_is_one_latent_row_per_token() -> None:
    # no separate K and V: 16 tokens * 1 * 576 * 2 bytes
    assert mla().page_size_bytes == 18432
    # fp8 per tensor: 16 * 576 * 1
    assert mla(dtype="float8_e4m3fn", kv_quant_mode=KVQuantMode.FP8_PER_TENSOR).page_size_bytes == (
        9216
    )
    # int4 per token-head: 576 / 2 bytes a row, plus 2 * 16 * 1 * 4 bytes of scales
    int4 = mla(dtype="uint8", kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)
    assert int4.page_size_bytes == 16 * 288 + 128


def test_fp8_ds_mla_row_layouts() -> None:
    # DeepSeek V3.2: 656 bytes per token (512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE)
    v32 = mla(block_size=64, dtype="uint8", cache_dtype_str="fp8_ds_mla")
    assert FP8_DS_MLA_ROW_BYTES_V32 == 656
    assert v32.page_size_bytes == 64 * 656
    # DeepSeek V4: 584 bytes per *stored* token; compress ratio 4 keeps 64 / 4 = 16 rows
    v4 = mla(
        block_size=64,
        head_size=512,
        dtype="uint8",
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
        compress_ratio=4,
    )
    assert FP8_DS_MLA_ROW_BYTES_V4 == 584
    assert v4.storage_block_size == 16
    assert v4.page_size_bytes == 16 * 584


def test_mla_alignment_padding_and_compress_ratio() -> None:
    # 18432 bytes rounded up to a multiple of 4096 -> 20480, recorded as the padded page
    aligned = mla(alignment=4096)
    assert aligned.real_page_size_bytes == 18432
    assert aligned.page_size_padded == 20480
    assert aligned.page_size_bytes == 20480
    # an aligned page needs no padding
    assert mla(alignment=2048).page_size_padded is None
    # a new block size recomputes the padding instead of keeping the old one:
    # 32 * 576 * 2 = 36864 B is already a multiple of 4096
    assert aligned.copy_with_new_block_size(32).page_size_padded is None
    assert aligned.copy_with_new_block_size(32).page_size_bytes == 36864
    assert mla(alignment=4096, block_size=8).page_size_bytes == 12288  # 9216 rounded up
    # a larger page given on purpose stays
    assert mla(alignment=4096, page_size_padded=40960).page_size_bytes == 40960
    # compress ratio 2: 8 stored rows of 576 bf16
    assert mla(compress_ratio=2).page_size_bytes == 8 * 576 * 2
    with pytest.raises(ValueError, match="compress_ratio"):
        mla(compress_ratio=3)


def test_sliding_window_mla() -> None:
    swa = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16", sliding_window=128
    )
    assert swa.page_size_bytes == 16 * 576 * 2
    assert swa.kind is KVCacheSpecKind.SLIDING_WINDOW_MLA
    v4 = SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        head_size=512,
        dtype="uint8",
        sliding_window=128,
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
        compress_ratio=4,
    )
    assert v4.page_size_bytes == 16 * 584
    with pytest.raises(ValueError, match="model_version"):
        replace(swa, model_version="glm")
    # bytes of a window of a 128-token window, 2 in-flight tokens: ceil(min(127 + 2, 100) / 16)
    # + 1 = 8 pages
    assert swa.max_memory_usage_bytes(CTX) == 8 * 18432


# ---- local attention ------------------------------------------------------------------


def test_sliding_window_admission_cap() -> None:
    spec = sliding(window=4, block_size=4)
    # the last 3 computed tokens + 2 in flight = 5 tokens -> 2 blocks, +1 because the
    # window need not start on a block boundary
    assert spec.max_admission_blocks_per_request(2, 100) == 3
    assert spec.max_memory_usage_bytes(CTX) == 3 * spec.page_size_bytes
    # capped by max_model_len: min(1023 + 8192, 100) = 100 tokens -> 7 + 1 blocks
    assert sliding(window=1024).max_admission_blocks_per_request(8192, 100) == 8
    with pytest.raises(ValueError, match="decode context parallelism"):
        spec.max_memory_usage_bytes(replace(CTX, dcp_world_size=2))
    with pytest.raises(ValueError, match="sliding_window"):
        sliding(window=0)


def test_sliding_window_page_matches_full_attention() -> None:
    assert sliding().page_size_bytes == full().page_size_bytes == 16384
    assert sliding(head_size_v=32).page_size_bytes == 12288


def test_chunked_local_attention() -> None:
    spec = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", attention_chunk_size=512
    )
    # one chunk plus the tokens in flight: min(512 + 8192, 100000) = 8704 tokens -> 544 blocks
    assert spec.max_admission_blocks_per_request(8192, 100_000) == 544
    ctx = SizingContext(max_model_len=100_000)
    assert spec.max_memory_usage_bytes(ctx) == 544 * spec.page_size_bytes
    # AttentionSpec's K+V page: 2 * 16 * 2 * 64 * 4
    assert spec.page_size_bytes == 16384
    assert spec.kind is KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION


# ---- mamba ----------------------------------------------------------------------------


def test_mamba_state_page_and_padding() -> None:
    # conv (2, 512) fp32 = 4096 bytes + ssm (3, 32, 32) fp32 = 12288 bytes
    assert mamba().page_size_bytes == 16384
    assert mamba(page_size_padded=20000).page_size_bytes == 20000
    assert mamba(page_size_padded=20000).real_page_size_bytes == 16384
    mixed = mamba(shapes=((3, 8192), (8192, 16)), dtypes=("bfloat16", "float32"))
    assert mixed.page_size_bytes == 3 * 8192 * 2 + 8192 * 16 * 4
    with pytest.raises(ValueError, match="smaller than the mamba state"):
        mamba(page_size_padded=100)
    with pytest.raises(ValueError, match="2 state shapes but 1 dtypes"):
        mamba(dtypes=("float32",))
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        mamba(mamba_cache_mode="some")


@pytest.mark.parametrize(
    ("mode", "pages", "row"),
    [
        # one live state (+ 2 speculative); the block table row holds the same 3
        ("none", 3, 3),
        # two live states at block boundaries (+2); rows index positions: ceil(100/16) + 2
        ("align", 4, 9),
        # a state per block: ceil(100 / 16) + 2 speculative
        ("all", 9, 9),
    ],
)
def test_mamba_cache_modes(mode: str, pages: int, row: int) -> None:
    spec = mamba(mamba_cache_mode=mode)
    assert spec.max_memory_usage_bytes(CTX) == pages * 16384
    assert spec.max_num_blocks_per_req(CTX, 100) == row


# ---- the other kinds ------------------------------------------------------------------


def test_cross_attention_is_sized_by_the_encoder() -> None:
    spec = CrossAttentionSpec(block_size=16, num_kv_heads=20, head_size=64, dtype="float16")
    # 1500 encoder positions -> ceil(1500 / 16) = 94 pages of 16 * 20 * 128 * 2 bytes
    assert spec.page_size_bytes == 81920
    assert spec.max_memory_usage_bytes(CTX) == 94 * 81920
    assert not spec.participates_in_prefix_caching


def test_encoder_only_needs_no_cache() -> None:
    spec = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
    assert spec.max_memory_usage_bytes(CTX) == 0
    assert spec.kind is KVCacheSpecKind.ENCODER_ONLY_ATTENTION


def test_sink_full_attention() -> None:
    spec = SinkFullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sink_len=4
    )
    assert spec.page_size_bytes == 16384
    assert spec.kind is KVCacheSpecKind.SINK_FULL_ATTENTION
    assert merge_layer_specs({"a": spec, "b": spec}) == spec
    with pytest.raises(SpecMergeError, match="sink_len"):
        merge_layer_specs({"a": spec, "b": replace(spec, sink_len=8)})


def test_hidden_state_cache() -> None:
    spec = HiddenStateCacheSpec(block_size=16, num_kv_heads=3, head_size=1024, dtype="bfloat16")
    # stored like an MLA row: 3 hidden states of 1024 bf16 per token
    assert spec.page_size_bytes == 16 * 3 * 1024 * 2
    assert spec.kind is KVCacheSpecKind.MLA_ATTENTION
    assert spec.type_name == "hidden_state"


def test_uniform_type_collection() -> None:
    specs = {"a": full(), "b": full(head_size=128)}
    uniform = UniformTypeKVCacheSpecs.from_specs(specs)
    assert uniform is not None
    # one block id addresses a page in each layer: 16384 + 32768
    assert uniform.page_size_bytes == 49152
    # both layers need ceil(100 / 16) = 7 pages
    assert uniform.max_memory_usage_pages(CTX) == 7
    assert uniform.max_memory_usage_bytes(CTX) == 7 * 49152
    assert uniform.max_num_blocks_per_req(CTX, 100) == 7
    assert uniform.get_page_sizes() == [16384, 32768]
    assert uniform.kind is KVCacheSpecKind.FULL_ATTENTION
    assert list(iter_layer_specs(uniform)) == [full(), full(head_size=128)]
    assert uniform.copy_with_new_block_size(32).kv_cache_specs["a"].block_size == 32

    # not one type: full + sliding, different block sizes, different windows
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": sliding()}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": sliding(), "b": full()}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": full(block_size=32)}) is None
    assert UniformTypeKVCacheSpecs.is_uniform_type(
        {"a": sliding(4), "b": sliding(4, head_size=128)}
    )
    assert not UniformTypeKVCacheSpecs.is_uniform_type({"a": sliding(4), "b": sliding(8)})
    assert not UniformTypeKVCacheSpecs.is_uniform_type(
        {"a": mamba(), "b": mamba(num_speculative_blocks=0)}
    )
    # MLA is full attention for slot counting, so it joins full-attention layers
    mixed = UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": mla()})
    assert mixed is not None
    assert mixed.kind is KVCacheSpecKind.FULL_ATTENTION
    swa_mla = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16", sliding_window=8
    )
    unknown = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": mla(), "b": swa_mla})
    assert unknown.kind is KVCacheSpecKind.UNKNOWN
    # layers whose block tables would differ in width cannot form one group
    # (full attention: ceil(100 / 16) = 7 entries; mamba in mode none: 1 + 2 speculative)
    bad = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": mamba()})
    with pytest.raises(ValueError, match="block-table widths"):
        bad.max_num_blocks_per_req(CTX, 100)


def test_kind_names() -> None:
    assert full().kind == "full_attention"
    assert mla().kind == "mla_attention"
    assert sliding().kind == "sliding_window"
    assert mamba().kind == "mamba"
    assert CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="int8").kind == (
        "cross_attention"
    )
    assert sliding_window_of(sliding(7)) == 7
    assert sliding_window_of(full(sliding_window=7)) is None  # promoted: allocates fully
    assert sliding_window_of(UniformTypeKVCacheSpecs.from_specs({"a": sliding(7)})) == 7  # type: ignore[arg-type]


# ---- merges ---------------------------------------------------------------------------


def test_merge_full_attention() -> None:
    merged = merge_layer_specs({"a": full(num_kv_heads=32), "b": full(num_kv_heads=32)})
    assert merged == full(num_kv_heads=32)
    with pytest.raises(
        SpecMergeError, match=r"layer b has num_kv_heads=16 but layer a has num_kv_heads=32"
    ):
        merge_layer_specs({"a": full(num_kv_heads=32), "b": full(num_kv_heads=16)})
    # a recorded window joins a plain full-attention layer ...
    assert merge_layer_specs({"a": full(sliding_window=1), "b": full()}).sliding_window == 1
    # ... but two different windows do not
    with pytest.raises(SpecMergeError, match=r"same sliding window; got \[1, 2\]"):
        merge_layer_specs({"a": full(sliding_window=1), "b": full(sliding_window=2), "c": full()})
    with pytest.raises(SpecMergeError, match="both sliding-window and chunked-local"):
        merge_layer_specs({"a": full(sliding_window=4), "b": full(attention_chunk_size=8)})
    # one non-causal layer makes the group non-causal
    assert merge_layer_specs({"a": full(), "b": full(non_causal=True)}).non_causal


def test_merge_rejects_other_types_naming_the_layer() -> None:
    with pytest.raises(SpecMergeError, match="layer sw is SlidingWindowSpec"):
        merge_layer_specs({"fa": full(), "sw": sliding()})
    with pytest.raises(SpecMergeError, match="layer m is MLA"):
        merge_layer_specs({"fa": full(), "m": mla()})
    with pytest.raises(SpecMergeError, match="expected MLAAttentionSpec"):
        merge_layer_specs({"m": mla(), "fa": full()})
    with pytest.raises(SpecMergeError, match="cache_dtype_str"):
        merge_layer_specs({"m": mla(cache_dtype_str="fp8"), "n": mla()})
    with pytest.raises(SpecMergeError):
        merge_layer_specs({"a": mamba(), "b": mamba(num_speculative_blocks=0)})
    with pytest.raises(ValueError, match="empty"):
        merge_layer_specs({})


def test_merge_mla_and_sliding_window_mla() -> None:
    assert merge_layer_specs({"a": mla(), "b": mla()}) == mla()
    fp8 = mla(block_size=64, dtype="uint8", cache_dtype_str="fp8_ds_mla")
    assert merge_layer_specs({"a": fp8, "b": fp8}) == fp8
    swa = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16", sliding_window=128
    )
    assert merge_layer_specs({"a": swa, "b": swa}) == swa
    with pytest.raises(SpecMergeError, match="sliding_window"):
        merge_layer_specs({"a": swa, "b": replace(swa, sliding_window=256)})


# ---- JSON form ------------------------------------------------------------------------


ALL_KINDS: list[KVCacheSpec] = [
    full(head_size_v=32, sliding_window=8, non_causal=True),
    full(dtype="uint8", kv_quant_mode=KVQuantMode.NVFP4),
    mla(alignment=4096),
    mla(block_size=64, dtype="uint8", cache_dtype_str="fp8_ds_mla"),
    HiddenStateCacheSpec(block_size=16, num_kv_heads=3, head_size=1024, dtype="bfloat16"),
    SinkFullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32", sink_len=4),
    sliding(window=128, page_size_padded=20000),
    SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16", sliding_window=128
    ),
    ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype="float32", attention_chunk_size=512
    ),
    mamba(page_size_padded=20000, mamba_type="mamba1", mamba_cache_mode="align"),
    EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float32"),
    CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16"),
    UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": full(head_size=128)}),
]


@pytest.mark.parametrize("spec", ALL_KINDS, ids=lambda s: s.type_name)
def test_every_kind_round_trips_through_json(spec: KVCacheSpec) -> None:
    data = json.loads(json.dumps(spec_to_dict(spec)))
    back = spec_from_dict(data)
    assert back == spec
    assert type(back) is type(spec)
    assert back.page_size_bytes == spec.page_size_bytes


def test_every_spec_type_is_covered() -> None:
    assert {s.type_name for s in ALL_KINDS} == set(SPEC_TYPES)


def test_spec_from_dict_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown spec type 'flash'; valid types: "):
        spec_from_dict({"type": "flash"})
    with pytest.raises(ValueError, match="unknown field"):
        spec_from_dict({**spec_to_dict(full()), "heads": 3})
    with pytest.raises(ValueError, match="layer x"):
        spec_from_dict({"type": "full_attention", "block_size": 16}, where="layer x")
    with pytest.raises(ValueError, match="kv_quant_mode"):
        spec_from_dict({**spec_to_dict(full()), "kv_quant_mode": "fp3"})
    with pytest.raises(ValueError, match="unknown dtype"):
        spec_from_dict({**spec_to_dict(full()), "dtype": "float9"})


def test_config_round_trips_through_json() -> None:
    config = KVCacheConfig(
        num_blocks=10,
        kv_cache_tensors=[
            KVCacheTensor(size=163840, shared_by=["a", "b"]),
            KVCacheTensor(size=163840, shared_by=["c"], offset=64, block_stride=128),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["a", "c"], full()),
            KVCacheGroupSpec(["b"], sliding(), is_eagle_group=True),
        ],
    )
    assert config_from_dict(json.loads(json.dumps(config_to_dict(config)))) == config
    assert config.layer_names == ["a", "c", "b"]
    assert config.layer_spec("b") == sliding()
    assert not config.needs_kv_cache_zeroing
    with_mamba = replace(config, kv_cache_groups=[KVCacheGroupSpec(["m"], mamba())])
    assert with_mamba.needs_kv_cache_zeroing
    mixed = replace(
        config,
        kv_cache_groups=[
            KVCacheGroupSpec(["a"], full()),
            KVCacheGroupSpec(["b"], full(dtype="float8_e4m3fn", kv_quant_mode=KVQuantMode(1))),
        ],
    )
    assert mixed.has_mixed_precision_kv_cache and mixed.needs_kv_cache_zeroing


@settings(deadline=None, max_examples=100)
@given(
    block_size=st.sampled_from([1, 8, 16, 32, 64, 128]),
    heads=st.integers(1, 64),
    head_size=st.sampled_from([32, 64, 96, 128, 256]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn"]),
    window=st.none() | st.integers(1, 10_000),
    max_len=st.integers(1, 1_000_000),
)
def test_attention_properties(
    block_size: int, heads: int, head_size: int, dtype: str, window: int | None, max_len: int
) -> None:
    spec: KVCacheSpec
    args = {"block_size": block_size, "num_kv_heads": heads, "head_size": head_size, "dtype": dtype}
    spec = (
        FullAttentionSpec(**args)
        if window is None
        else SlidingWindowSpec(sliding_window=window, **args)
    )  # type: ignore[arg-type]
    ctx = SizingContext(max_model_len=max_len)
    # pages scale linearly with the block, and a request's memory is whole pages
    assert spec.copy_with_new_block_size(2 * block_size).page_size_bytes == 2 * spec.page_size_bytes
    assert spec.max_memory_usage_bytes(ctx) % spec.page_size_bytes == 0
    # a longer limit never needs less
    assert spec.max_memory_usage_bytes(ctx.with_max_model_len(max_len + 1)) >= (
        spec.max_memory_usage_bytes(ctx)
    )
    assert spec_from_dict(spec_to_dict(spec)) == spec
