"""kvsvc.models: from Hugging Face configs (bundled and hand-made) to per-rank layer specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvsvc.errors import InvalidArgument
from kvsvc.models import (
    SUPPORTED_MODEL_TYPES,
    ModelSpecOptions,
    align_attention_to_mamba,
    bundled_config_path,
    default_max_model_len,
    default_max_num_encoder_input_tokens,
    dump_spec_file,
    extract_layer_index,
    get_pp_indices,
    kv_heads_per_rank,
    layer_specs_all_ranks,
    layer_specs_for_rank,
    list_bundled_configs,
    load_model_config,
    load_spec_file,
    mamba1_state_shapes,
    model_dtype,
    resolve_model_config,
    split_specs_over_ranks,
    total_num_kv_heads,
)
from kvsvc.specs import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)


def bundled(name: str) -> dict[str, Any]:
    return load_model_config(bundled_config_path(name))


def windows(specs: dict[str, Any]) -> list[int | None]:
    return [s.sliding_window if isinstance(s, SlidingWindowSpec) else None for s in specs.values()]


def tiny(model_type: str = "llama", **fields: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    cfg.update(fields)
    return cfg


# ---- bundled configs ------------------------------------------------------------------


def test_bundled_configs_cover_the_required_families() -> None:
    names = list_bundled_configs()
    for name in (
        "llama-3.2-1b",
        "llama-3.1-8b",
        "mistral-7b-v0.1",
        "qwen2.5-7b",
        "qwen3-8b",
        "gemma-2-9b",
        "gemma-3-4b",
        "gemma-3-12b",
        "deepseek-v2-lite",
        "deepseek-v3",
        "jamba-v0.1",
        "whisper-large-v3",
    ):
        assert name in names
    assert bundled_config_path("Llama-3.2-1B.json") == bundled_config_path("llama-3.2-1b")
    with pytest.raises(InvalidArgument, match="no bundled config named 'gpt-9'; bundled: "):
        bundled_config_path("gpt-9")


@pytest.mark.parametrize(
    ("name", "max_len"),
    [
        ("llama-3.2-1b", 131072),
        ("mistral-7b-v0.1", 32768),
        ("qwen3-8b", 40960),
        ("gemma-2-9b", 8192),
        ("gemma-3-12b", 131072),
        ("deepseek-v3", 163840),
        ("jamba-v0.1", 262144),
        ("whisper-large-v3", 448),
    ],
)
def test_default_max_model_len(name: str, max_len: int) -> None:
    assert default_max_model_len(bundled(name)) == max_len


def test_model_dtype() -> None:
    assert model_dtype(bundled("llama-3.2-1b")) == "bfloat16"
    # gemma-2-9b ships float32 weights; vLLM's auto runs them in bfloat16
    assert model_dtype(bundled("gemma-2-9b")) == "bfloat16"
    assert model_dtype(bundled("whisper-large-v3")) == "float16"
    assert model_dtype(bundled("gemma-3-4b")) == "bfloat16"  # from the multimodal wrapper
    assert model_dtype(bundled("gemma-2-9b"), "float32") == "float32"
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        model_dtype(bundled("llama-3.2-1b"), "float9")


# ---- llama and the TP / PP split ------------------------------------------------------


def test_llama_layers_tp1() -> None:
    specs = layer_specs_for_rank(bundled("llama-3.2-1b"), ModelSpecOptions(), 0)
    assert list(specs) == [f"model.layers.{i}.self_attn.attn" for i in range(16)]
    spec = specs["model.layers.0.self_attn.attn"]
    assert spec == FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype="bfloat16")
    # 16 tokens * 8 heads * (64 + 64) * 2 bytes
    assert spec.page_size_bytes == 32768


@pytest.mark.parametrize(("tp", "kv_heads"), [(1, 8), (2, 4), (8, 1), (16, 1), (32, 1)])
def test_kv_heads_split_over_tp_and_replicate_below_one(tp: int, kv_heads: int) -> None:
    specs = layer_specs_for_rank(bundled("llama-3.1-8b"), ModelSpecOptions(tp=tp), tp - 1)
    assert {s.num_kv_heads for s in specs.values()} == {kv_heads}  # type: ignore[attr-defined]


def test_tp_that_does_not_divide_the_heads_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match="num_attention_heads=32 is not divisible by tp=3"):
        layer_specs_all_ranks(bundled("llama-3.1-8b"), ModelSpecOptions(tp=3))
    with pytest.raises(InvalidArgument, match="num_attention_heads=32 is not divisible by tp=64"):
        layer_specs_all_ranks(bundled("llama-3.1-8b"), ModelSpecOptions(tp=64))
    # 24 query heads split over 12 ranks, but 8 KV heads cannot be copied onto 12 ranks
    with pytest.raises(InvalidArgument, match="tp=12 is not a multiple of num_key_value_heads=8"):
        kv_heads_per_rank(8, 24, 12)
    assert kv_heads_per_rank(8, 24, 24) == 1
    with pytest.raises(InvalidArgument, match="num_key_value_heads=6 is not divisible by tp=4"):
        kv_heads_per_rank(6, 24, 4)


@pytest.mark.parametrize(
    ("num_layers", "pp", "expected"),
    [
        (32, 4, [(0, 8), (8, 16), (16, 24), (24, 32)]),
        # remainder 2 goes to the stages before the last: [2, 3, 3, 2]
        (10, 4, [(0, 2), (2, 5), (5, 8), (8, 10)]),
        # remainder 1 over 3 stages: [5, 6, 5]
        (16, 3, [(0, 5), (5, 11), (11, 16)]),
        # two stages: the first takes the extra layer
        (7, 2, [(0, 4), (4, 7)]),
        # remainder 3 over 4 stages: every stage but the last
        (11, 4, [(0, 3), (3, 6), (6, 9), (9, 11)]),
    ],
)
def test_pp_split_follows_vllm(num_layers: int, pp: int, expected: list[tuple[int, int]]) -> None:
    assert [get_pp_indices(num_layers, r, pp) for r in range(pp)] == expected


def test_pp_explicit_partition() -> None:
    assert [get_pp_indices(10, r, 2, [3, 7]) for r in range(2)] == [(0, 3), (3, 10)]
    with pytest.raises(InvalidArgument, match="sum to 10 layers"):
        get_pp_indices(10, 0, 2, [3, 6])
    with pytest.raises(InvalidArgument, match="has 3 entries but there are 2"):
        get_pp_indices(10, 0, 2, [3, 3, 4])


def test_all_ranks_are_indexed_pp_major() -> None:
    cfg = bundled("llama-3.2-1b")
    ranks = layer_specs_all_ranks(cfg, ModelSpecOptions(tp=2, pp=3))
    assert len(ranks) == 6
    # 16 layers over 3 stages: [5, 6, 5]; ranks 2*s and 2*s+1 share stage s
    assert [len(r) for r in ranks] == [5, 5, 6, 6, 5, 5]
    assert ranks[2] == ranks[3]
    assert next(iter(ranks[2])) == "model.layers.5.self_attn.attn"
    assert ranks[4] == layer_specs_for_rank(cfg, ModelSpecOptions(tp=2, pp=3), 4)
    with pytest.raises(InvalidArgument, match=r"rank: must be in \[0, 6\)"):
        layer_specs_for_rank(cfg, ModelSpecOptions(tp=2, pp=3), 6)


def test_options_are_validated() -> None:
    with pytest.raises(InvalidArgument, match="tp: must be a positive integer"):
        ModelSpecOptions(tp=0)
    with pytest.raises(InvalidArgument, match="kv_cache_dtype: unknown value 'fp7'"):
        ModelSpecOptions(kv_cache_dtype="fp7")
    with pytest.raises(InvalidArgument, match="mamba_cache_mode"):
        ModelSpecOptions(mamba_cache_mode="most")
    with pytest.raises(InvalidArgument, match="dtype"):
        ModelSpecOptions(dtype="float9")


@pytest.mark.parametrize(
    ("kv_cache_dtype", "dtype", "mode", "page"),
    [
        ("auto", "bfloat16", KVQuantMode.NONE, 32768),
        ("fp8", "float8_e4m3fn", KVQuantMode.FP8_PER_TENSOR, 16384),
        # + fp32 scales: 2 (K, V) * 16 tokens * 8 heads * 4 bytes
        ("int8_per_token_head", "int8", KVQuantMode.INT8_PER_TOKEN_HEAD, 16384 + 1024),
    ],
)
def test_kv_cache_dtype(kv_cache_dtype: str, dtype: str, mode: KVQuantMode, page: int) -> None:
    opts = ModelSpecOptions(kv_cache_dtype=kv_cache_dtype)
    spec = layer_specs_for_rank(bundled("llama-3.2-1b"), opts, 0)["model.layers.0.self_attn.attn"]
    assert (spec.dtype, spec.kv_quant_mode, spec.page_size_bytes) == (dtype, mode, page)  # type: ignore[attr-defined]


def test_head_dim_falls_back_to_hidden_over_heads() -> None:
    specs = layer_specs_for_rank(tiny(), ModelSpecOptions(), 0)
    assert {s.head_size for s in specs.values()} == {32}  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="hidden_size=250 is not divisible"):
        layer_specs_for_rank(tiny(hidden_size=250), ModelSpecOptions(), 0)
    with pytest.raises(InvalidArgument, match="num_hidden_layers"):
        layer_specs_for_rank(tiny(num_hidden_layers=None), ModelSpecOptions(), 0)


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(InvalidArgument) as info:
        layer_specs_all_ranks(tiny("gpt_neox"), ModelSpecOptions())
    message = str(info.value)
    assert "unsupported model_type 'gpt_neox'" in message
    for model_type in ("llama", "qwen3", "gemma3", "deepseek_v3", "jamba", "whisper"):
        assert model_type in message
    assert set(SUPPORTED_MODEL_TYPES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma2"}


# ---- sliding windows ------------------------------------------------------------------


def test_mistral_slides_every_layer() -> None:
    specs = layer_specs_for_rank(bundled("mistral-7b-v0.1"), ModelSpecOptions(), 0)
    assert windows(specs) == [4096] * 32
    off = layer_specs_for_rank(
        bundled("mistral-7b-v0.1"), ModelSpecOptions(disable_sliding_window=True), 0
    )
    assert all(type(s) is FullAttentionSpec for s in off.values())


def test_qwen_honours_use_sliding_window_and_max_window_layers() -> None:
    # Qwen2.5-7B ships use_sliding_window=false: all full attention
    assert (
        windows(layer_specs_for_rank(bundled("qwen2.5-7b"), ModelSpecOptions(), 0)) == [None] * 28
    )
    cfg = tiny("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert windows(layer_specs_for_rank(cfg, ModelSpecOptions(), 0)) == [None, None, 64, 64]
    cfg = tiny(
        "qwen3",
        use_sliding_window=True,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    assert windows(layer_specs_for_rank(cfg, ModelSpecOptions(), 0)) == [64, None, 64, None]
    # layer_types is ignored while use_sliding_window is off
    cfg["use_sliding_window"] = False
    assert windows(layer_specs_for_rank(cfg, ModelSpecOptions(), 0)) == [None] * 4


def test_gemma2_alternates_sliding_and_full() -> None:
    specs = layer_specs_for_rank(bundled("gemma-2-9b"), ModelSpecOptions(tp=2), 0)
    assert windows(specs) == [4096, None] * 21
    first = next(iter(specs.values()))
    assert (first.num_kv_heads, first.head_size, first.dtype) == (4, 256, "bfloat16")  # type: ignore[attr-defined]


def test_gemma3_pattern_and_wrapper_names() -> None:
    specs = layer_specs_for_rank(bundled("gemma-3-12b"), ModelSpecOptions(), 0)
    assert len(specs) == 48
    assert next(iter(specs)) == "language_model.model.layers.0.self_attn.attn"
    # every 6th layer (5, 11, ..., 47) is global
    assert windows(specs) == ([1024] * 5 + [None]) * 8
    # the 4B config leaves heads to Gemma3TextConfig's defaults: 8 heads, 4 KV heads
    specs_4b = layer_specs_for_rank(bundled("gemma-3-4b"), ModelSpecOptions(), 0)
    assert len(specs_4b) == 34
    assert {s.num_kv_heads for s in specs_4b.values()} == {4}  # type: ignore[attr-defined]
    text_only = tiny("gemma3_text", head_dim=64, sliding_window=32, sliding_window_pattern=2)
    specs_text = layer_specs_for_rank(text_only, ModelSpecOptions(), 0)
    assert next(iter(specs_text)) == "model.layers.0.self_attn.attn"
    assert windows(specs_text) == [32, None, 32, None]
    explicit = tiny("gemma2", sliding_window=8, layer_types=["full_attention"] * 4)
    assert windows(layer_specs_for_rank(explicit, ModelSpecOptions(), 0)) == [None] * 4
    with pytest.raises(InvalidArgument, match="layer_types"):
        layer_specs_for_rank(tiny("gemma2", layer_types=["full_attention"]), ModelSpecOptions(), 0)


# ---- MLA ------------------------------------------------------------------------------


def test_deepseek_mla_is_one_latent_head_on_every_rank() -> None:
    specs = layer_specs_all_ranks(bundled("deepseek-v3"), ModelSpecOptions(tp=8, pp=2))
    assert sum(len(r) for r in specs[::8]) == 61
    spec = specs[0]["model.layers.0.self_attn.attn"]
    # kv_lora_rank 512 + qk_rope_head_dim 64
    assert spec == MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert spec.page_size_bytes == 16 * 576 * 2
    assert total_num_kv_heads(bundled("deepseek-v3")) is None
    lite = layer_specs_for_rank(bundled("deepseek-v2-lite"), ModelSpecOptions(), 0)
    assert len(lite) == 27


def test_deepseek_kv_cache_dtypes() -> None:
    cfg = bundled("deepseek-v3")
    spec = layer_specs_for_rank(cfg, ModelSpecOptions(kv_cache_dtype="fp8"), 0)[
        "model.layers.0.self_attn.attn"
    ]
    assert (spec.dtype, spec.cache_dtype_str, spec.page_size_bytes) == (
        "float8_e4m3fn",
        "fp8",
        9216,
    )  # type: ignore[attr-defined]
    # DeepSeek V3.2 (index_topk) stores fp8 in its 656-byte row layout
    v32 = dict(cfg, index_topk=2048)
    spec = layer_specs_for_rank(v32, ModelSpecOptions(kv_cache_dtype="fp8", block_size=64), 0)[
        "model.layers.0.self_attn.attn"
    ]
    assert (spec.cache_dtype_str, spec.page_size_bytes) == ("fp8_ds_mla", 64 * 656)  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgument, match="nvfp4 is not supported for MLA"):
        layer_specs_for_rank(cfg, ModelSpecOptions(kv_cache_dtype="nvfp4"), 0)
    with pytest.raises(InvalidArgument, match="fp8_ds_mla is DeepSeek's MLA row format"):
        layer_specs_for_rank(
            bundled("llama-3.2-1b"), ModelSpecOptions(kv_cache_dtype="fp8_ds_mla"), 0
        )


# ---- Mamba (jamba) --------------------------------------------------------------------


def test_mamba1_state_shapes() -> None:
    # conv: the last d_conv - 1 = 3 inputs of the rank's 8192 / 2 channels; ssm (4096, 16)
    assert mamba1_state_shapes(2, 8192, 16, 4) == ((3, 4096), (4096, 16))
    with pytest.raises(InvalidArgument, match="not divisible by tp=3"):
        mamba1_state_shapes(3, 8192, 16, 4)


def test_jamba_aligns_attention_and_mamba_pages() -> None:
    cfg = bundled("jamba-v0.1")
    specs = layer_specs_for_rank(cfg, ModelSpecOptions(), 0)
    attention = [n for n, s in specs.items() if isinstance(s, FullAttentionSpec)]
    assert attention == [f"model.layers.{i}.self_attn.attn" for i in (4, 12, 20, 28)]
    mamba = specs["model.layers.0.mamba"]
    assert isinstance(mamba, MambaSpec)
    # mamba_expand 2 * hidden 4096 = 8192 channels, d_state 16, d_conv 4, bf16:
    # conv 3 * 8192 * 2 = 49152 B + ssm 8192 * 16 * 2 = 262144 B = 311296 B
    assert mamba.shapes == ((3, 8192), (8192, 16))
    assert mamba.dtypes == ("bfloat16", "bfloat16")
    assert mamba.real_page_size_bytes == 311296
    # attention per token: 8 heads * (128 + 128) * 2 B = 4096 B; the smallest 16-aligned
    # block holding a state: 16 * ceil(311296 / (16 * 4096)) = 80 tokens -> 327680 B page
    attn = specs["model.layers.4.self_attn.attn"]
    assert attn.block_size == 80
    assert attn.page_size_bytes == 327680
    assert mamba.page_size_bytes == 327680
    assert mamba.mamba_type == "mamba1"
    # mode none keeps one state per request: Mamba's block is the whole max length
    assert mamba.block_size == 262144
    assert total_num_kv_heads(cfg) == 8


def test_jamba_tp2_and_cache_modes() -> None:
    cfg = bundled("jamba-v0.1")
    specs = layer_specs_for_rank(cfg, ModelSpecOptions(tp=2, max_model_len=4096), 0)
    mamba = specs["model.layers.0.mamba"]
    # half the channels and half the KV heads: 155648 B state, 2048 B per token, block 80
    assert mamba.real_page_size_bytes == 155648  # type: ignore[attr-defined]
    assert specs["model.layers.4.self_attn.attn"].block_size == 80
    assert mamba.page_size_bytes == 80 * 2048
    assert mamba.block_size == 4096

    align = layer_specs_for_rank(cfg, ModelSpecOptions(mamba_cache_mode="align"), 0)
    assert align["model.layers.0.mamba"].block_size == 80

    # mode all: ceil(311296 / 4096) = 76 tokens per state, rounded up to the 256-token chunk
    every = layer_specs_for_rank(cfg, ModelSpecOptions(mamba_cache_mode="all"), 0)
    assert every["model.layers.4.self_attn.attn"].block_size == 256
    assert every["model.layers.0.mamba"].block_size == 256
    assert every["model.layers.0.mamba"].page_size_bytes == 256 * 4096

    # an fp32 SSM state: 49152 + 524288 = 573440 B -> 16 * ceil(573440 / 65536) = 144 tokens
    fp32 = layer_specs_for_rank(cfg, ModelSpecOptions(mamba_ssm_cache_dtype="float32"), 0)
    assert fp32["model.layers.0.mamba"].dtypes == ("bfloat16", "float32")  # type: ignore[attr-defined]
    assert fp32["model.layers.4.self_attn.attn"].block_size == 144

    # a larger user block wins; the mamba page is padded to it
    big = layer_specs_for_rank(cfg, ModelSpecOptions(block_size=128, num_speculative_tokens=2), 0)
    assert big["model.layers.4.self_attn.attn"].block_size == 128
    assert big["model.layers.0.mamba"].page_size_bytes == 128 * 4096
    assert big["model.layers.0.mamba"].num_speculative_blocks == 2  # type: ignore[attr-defined]


def test_align_attention_to_mamba() -> None:
    got = align_attention_to_mamba(
        attention_page_per_token=4096,
        mamba_page_size=311296,
        block_size=16,
        mamba_cache_mode="none",
        max_model_len=1000,
    )
    assert got == (80, 1000, 327680)
    # an unaligned user block too small for the state grows to hold it exactly
    got = align_attention_to_mamba(
        attention_page_per_token=4096,
        mamba_page_size=311296,
        block_size=16,
        mamba_cache_mode="none",
        max_model_len=1000,
        kernel_block_alignment=1,
    )
    assert got == (76, 1000, 76 * 4096)


# ---- encoder-decoder ------------------------------------------------------------------


def test_whisper_decoder_self_and_cross_attention() -> None:
    cfg = bundled("whisper-large-v3")
    specs = layer_specs_for_rank(cfg, ModelSpecOptions(tp=2), 0)
    assert len(specs) == 64
    self_attn = specs["model.decoder.layers.0.self_attn.attn"]
    cross = specs["model.decoder.layers.0.encoder_attn.attn"]
    assert isinstance(self_attn, FullAttentionSpec)
    assert isinstance(cross, CrossAttentionSpec)
    # 20 heads over 2 ranks, d_model 1280 / 20 = 64, fp16: 16 * 10 * 128 * 2
    assert self_attn.page_size_bytes == cross.page_size_bytes == 40960
    assert default_max_num_encoder_input_tokens(cfg) == 1500
    assert default_max_num_encoder_input_tokens(bundled("llama-3.2-1b")) == 0
    with pytest.raises(InvalidArgument, match="whisper does not support pipeline parallelism"):
        layer_specs_all_ranks(cfg, ModelSpecOptions(pp=2))
    with pytest.raises(InvalidArgument, match="not divisible by tp=8"):
        layer_specs_all_ranks(cfg, ModelSpecOptions(tp=8))


# ---- files ----------------------------------------------------------------------------


def test_load_model_config_errors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny()))
    assert load_model_config(tmp_path)["model_type"] == "llama"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="is not valid JSON"):
        load_model_config(tmp_path / "bad.json")
    (tmp_path / "nomodel.json").write_text("{}")
    with pytest.raises(InvalidArgument, match="no 'model_type' field"):
        load_model_config(tmp_path / "nomodel.json")
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_model_config(tmp_path / "missing.json")
    # a path-looking argument reports the missing file, not an unknown bundled name
    with pytest.raises(InvalidArgument, match="cannot read"):
        resolve_model_config(str(tmp_path / "missing.json"))
    config, display = resolve_model_config("qwen3-8b")
    assert config["model_type"] == "qwen3" and display == "qwen3-8b"


def test_spec_file_round_trip_and_pp_split(tmp_path: Path) -> None:
    specs = layer_specs_for_rank(bundled("gemma-2-9b"), ModelSpecOptions(), 0)
    path = tmp_path / "specs.json"
    dump_spec_file(specs, path)
    loaded = load_spec_file(path)
    assert loaded == specs
    ranks = split_specs_over_ranks(loaded, tp=2, pp=2)
    # 42 layers over 2 stages: 21 each
    assert [len(r) for r in ranks] == [21, 21, 21, 21]
    assert "model.layers.21.self_attn.attn" in ranks[2]
    assert split_specs_over_ranks(loaded, tp=3) == [loaded] * 3
    assert extract_layer_index("model.decoder.layers.3.encoder_attn.attn") == 3
    with pytest.raises(InvalidArgument, match="exactly one numeric component"):
        split_specs_over_ranks({"lm_head": specs["model.layers.0.self_attn.attn"]}, pp=2)


def test_spec_file_errors(tmp_path: Path) -> None:
    path = tmp_path / "specs.json"
    path.write_text(json.dumps([{"type": "full_attention"}]))
    with pytest.raises(InvalidArgument, match="non-empty JSON object of layer name -> spec"):
        load_spec_file(path)
    path.write_text(
        json.dumps({"model.layers.0.attn": {"type": "full_attention", "block_size": 16}})
    )
    with pytest.raises(InvalidArgument, match=r"layer 'model\.layers\.0\.attn'"):
        load_spec_file(path)
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_spec_file(tmp_path / "nope.json")
