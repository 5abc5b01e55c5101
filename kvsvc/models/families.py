"""From a Hugging Face config to the KV cache spec of every layer, per parallel rank.

Each supported family maps its config onto layers the way vLLM's model implementation
registers them (layer names included, so a plan made here lines up with an engine's own
registration): which layers attend over a sliding window, which are MLA, Mamba or
cross-attention, how many KV heads a TP rank keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.models.config import model_dtype, require_int, text_config
from kvsvc.models.mamba import (
    DEFAULT_MAMBA_CHUNK_SIZE,
    KERNEL_BLOCK_ALIGNMENT,
    align_attention_to_mamba,
    mamba1_state_shapes,
)
from kvsvc.models.parallel import get_pp_indices, kv_heads_per_rank
from kvsvc.specs import (
    KV_CACHE_DTYPE_CHOICES,
    MAMBA_CACHE_MODES,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    canonical_dtype,
    resolve_kv_cache_dtype,
)


@dataclass(frozen=True, slots=True)
class ModelSpecOptions:
    """How the engine runs the model: parallelism, block size, dtypes, cache modes.

    Attributes:
        tp: tensor-parallel ranks per pipeline stage.
        pp: pipeline stages.
        block_size: tokens per KV cache block (hybrid Mamba models may raise it).
        dtype: model dtype (``auto``: the checkpoint's; float32 checkpoints run in bf16).
        kv_cache_dtype: ``auto`` (the model dtype) or a quantised mode (``fp8``, ...).
        mamba_cache_mode: ``none`` | ``align`` | ``all`` (Mamba state prefix caching).
        mamba_cache_dtype: conv-state dtype (``auto``: the model dtype, vLLM's default).
        mamba_ssm_cache_dtype: SSM-state dtype (``auto``: the conv-state dtype; ``float32``
            is vLLM's opt-in for accuracy).
        mamba_block_size: Mamba block size override (default per cache mode, see
            :func:`kvsvc.models.mamba.align_attention_to_mamba`).
        max_model_len: the Mamba block size in mode ``none``; default the model's own limit.
        num_speculative_tokens: draft tokens; Mamba keeps one extra state block per token.
        disable_sliding_window: treat sliding-window layers as full attention.
        pp_layer_partition: explicit layers per pipeline stage (vLLM's
            ``VLLM_PP_LAYER_PARTITION``).
    """

    tp: int = 1
    pp: int = 1
    block_size: int = 16
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mamba_cache_mode: str = "none"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None
    max_model_len: int | None = None
    num_speculative_tokens: int = 0
    disable_sliding_window: bool = False
    pp_layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(name, f"must be a positive integer, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise InvalidArgument(
                "kv_cache_dtype",
                f"unknown value {self.kv_cache_dtype!r}; valid: "
                + ", ".join(KV_CACHE_DTYPE_CHOICES),
            )
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise InvalidArgument(
                "mamba_cache_mode",
                f"unknown value {self.mamba_cache_mode!r}; valid: " + ", ".join(MAMBA_CACHE_MODES),
            )
        for name in ("dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            value = getattr(self, name)
            if value != "auto":
                try:
                    canonical_dtype(value)
                except ValueError as exc:
                    raise InvalidArgument(name, str(exc)) from None
        if self.num_speculative_tokens < 0:
            raise InvalidArgument("num_speculative_tokens", "must be >= 0")
        for name in ("mamba_block_size", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgument(name, f"must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """One cache-holding layer: its decoder index (for PP), vLLM name and per-rank spec."""

    index: int
    name: str
    spec: KVCacheSpec


@dataclass(frozen=True, slots=True)
class ModelLayers:
    """Every cache-holding layer of a model at one TP degree, before the PP split."""

    model_type: str
    num_layers: int  # length of the decoder stack PP splits
    entries: tuple[LayerEntry, ...]


_Builder = Callable[[dict[str, Any], ModelSpecOptions, str], ModelLayers]


def _head_dims(cfg: dict[str, Any], tp: int) -> tuple[int, int]:
    """(KV heads per rank, head size) of a standard attention layer."""
    heads = require_int(cfg, "num_attention_heads")
    total_kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim")
    if not head_dim:
        hidden = require_int(cfg, "hidden_size")
        if hidden % heads:
            raise InvalidArgument(
                "head_dim",
                f"no head_dim in the config and hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}",
            )
        head_dim = hidden // heads
    return kv_heads_per_rank(int(total_kv), heads, tp), int(head_dim)


def _kv_storage(options: ModelSpecOptions, mdtype: str, *, mla: bool) -> tuple[str, KVQuantMode]:
    """(page element dtype, quant mode) of attention layers under ``--kv-cache-dtype``."""
    if options.kv_cache_dtype == "fp8_ds_mla" and not mla:
        raise InvalidArgument(
            "kv_cache_dtype", "fp8_ds_mla is DeepSeek's MLA row format; this model has no MLA"
        )
    if mla and options.kv_cache_dtype == "nvfp4":
        raise InvalidArgument("kv_cache_dtype", "nvfp4 is not supported for MLA layers")
    return resolve_kv_cache_dtype(options.kv_cache_dtype, mdtype)


def _attention(
    *, window: int | None, block_size: int, kv_heads: int, head_size: int, storage: tuple[str, Any]
) -> KVCacheSpec:
    dtype, mode = storage
    if window is None:
        return FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=kv_heads,
            head_size=head_size,
            dtype=dtype,
            kv_quant_mode=mode,
        )
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=dtype,
        kv_quant_mode=mode,
        sliding_window=window,
    )


def _layer_types_windows(cfg: dict[str, Any], n: int) -> list[int | None] | None:
    """Windows from an explicit ``layer_types`` list (newer transformers configs)."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        raise InvalidArgument(
            "layer_types", f"must list one type per layer ({n}), got {types!r:.80}"
        )
    window = cfg.get("sliding_window")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == "sliding_attention":
            if not window:
                raise InvalidArgument(
                    "sliding_window", f"layer {i} is sliding_attention but no window is set"
                )
            out.append(int(window))
        elif kind in ("full_attention", "attention"):
            out.append(None)
        else:
            raise InvalidArgument("layer_types", f"layer {i} has unsupported type {kind!r}")
    return out


def _sliding_windows(
    cfg: dict[str, Any], family: str, n: int, options: ModelSpecOptions
) -> list[int | None]:
    """The sliding window of each decoder layer (None = full attention)."""
    if options.disable_sliding_window:
        return [None] * n
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        # Qwen applies the window only when asked, and only from max_window_layers up.
        if not cfg.get("use_sliding_window") or not window:
            return [None] * n
        explicit = _layer_types_windows(cfg, n)
        if explicit is not None:
            return explicit
        first = int(cfg.get("max_window_layers") or 0)
        return [int(window) if i >= first else None for i in range(n)]
    explicit = _layer_types_windows(cfg, n)
    if explicit is not None:
        return explicit
    if not window:
        return [None] * n
    w = int(window)
    if family == "mistral":
        return [w] * n
    if family == "gemma2":
        return [w if i % 2 == 0 else None for i in range(n)]
    if family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return [w if (i + 1) % pattern else None for i in range(n)]
    return [None] * n


def _decoder_only(cfg: dict[str, Any], options: ModelSpecOptions, family: str) -> ModelLayers:
    n = require_int(cfg, "num_hidden_layers")
    kv_heads, head_size = _head_dims(cfg, options.tp)
    storage = _kv_storage(options, model_dtype(cfg, options.dtype), mla=False)
    windows = _sliding_windows(cfg, family, n, options)
    prefix = "language_model.model" if cfg.get("_wrapped") else "model"
    entries = tuple(
        LayerEntry(
            i,
            f"{prefix}.layers.{i}.self_attn.attn",
            _attention(
                window=windows[i],
                block_size=options.block_size,
                kv_heads=kv_heads,
                head_size=head_size,
                storage=storage,
            ),
        )
        for i in range(n)
    )
    return ModelLayers(str(cfg["model_type"]), n, entries)


def _deepseek(cfg: dict[str, Any], options: ModelSpecOptions, family: str) -> ModelLayers:
    n = require_int(cfg, "num_hidden_layers")
    # MLA caches one latent row per token: the compressed KV plus the decoupled RoPE key.
    # It is not split over TP: every rank keeps the whole latent (one "head").
    head_size = require_int(cfg, "kv_lora_rank") + require_int(cfg, "qk_rope_head_dim")
    if require_int(cfg, "num_attention_heads") % options.tp:
        raise InvalidArgument(
            "tp", f"num_attention_heads={cfg['num_attention_heads']} is not divisible by tp"
        )
    mdtype = model_dtype(cfg, options.dtype)
    dtype, mode = _kv_storage(options, mdtype, mla=True)
    cache_dtype_str: str | None = (
        None if options.kv_cache_dtype == "auto" else options.kv_cache_dtype
    )
    if "index_topk" in cfg and options.kv_cache_dtype.startswith("fp8"):
        # DeepSeek V3.2 stores fp8 caches in its own 656-byte row layout.
        cache_dtype_str, dtype, mode = "fp8_ds_mla", "uint8", KVQuantMode.FP8_PER_TENSOR
    spec = MLAAttentionSpec(
        block_size=options.block_size,
        num_kv_heads=1,
        head_size=head_size,
        dtype=dtype,
        kv_quant_mode=mode,
        cache_dtype_str=cache_dtype_str,
    )
    entries = tuple(LayerEntry(i, f"model.layers.{i}.self_attn.attn", spec) for i in range(n))
    return ModelLayers(str(cfg["model_type"]), n, entries)


def _jamba(cfg: dict[str, Any], options: ModelSpecOptions, family: str) -> ModelLayers:
    n = require_int(cfg, "num_hidden_layers")
    period = require_int(cfg, "attn_layer_period")
    offset = int(cfg.get("attn_layer_offset") or 0)
    kv_heads, head_size = _head_dims(cfg, options.tp)
    mdtype = model_dtype(cfg, options.dtype)
    storage = _kv_storage(options, mdtype, mla=False)

    hidden = require_int(cfg, "hidden_size")
    intermediate = require_int(cfg, "mamba_expand") * hidden
    shapes = mamba1_state_shapes(
        options.tp,
        intermediate,
        require_int(cfg, "mamba_d_state"),
        require_int(cfg, "mamba_d_conv"),
    )
    conv_dtype = mdtype if options.mamba_cache_dtype == "auto" else options.mamba_cache_dtype
    ssm_dtype = (
        conv_dtype if options.mamba_ssm_cache_dtype == "auto" else options.mamba_ssm_cache_dtype
    )
    dtypes = (canonical_dtype(conv_dtype), canonical_dtype(ssm_dtype))
    probe = MambaSpec(block_size=1, shapes=shapes, dtypes=dtypes)
    per_token = _attention(
        window=None, block_size=1, kv_heads=kv_heads, head_size=head_size, storage=storage
    ).page_size_bytes
    max_len = options.max_model_len or default_max_model_len(cfg)
    aligned = align_attention_to_mamba(
        attention_page_per_token=per_token,
        mamba_page_size=probe.page_size_bytes,
        block_size=options.block_size,
        mamba_cache_mode=options.mamba_cache_mode,
        max_model_len=max_len,
        mamba_block_size=options.mamba_block_size,
        kernel_block_alignment=KERNEL_BLOCK_ALIGNMENT,
        mamba_chunk_size=int(cfg.get("mamba_chunk_size") or DEFAULT_MAMBA_CHUNK_SIZE),
    )
    attention = _attention(
        window=None,
        block_size=aligned.attention_block_size,
        kv_heads=kv_heads,
        head_size=head_size,
        storage=storage,
    )
    mamba = MambaSpec(
        block_size=aligned.mamba_block_size,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=aligned.mamba_page_size_padded,
        mamba_type="mamba1",
        mamba_cache_mode=options.mamba_cache_mode,
        num_speculative_blocks=options.num_speculative_tokens,
    )
    entries = tuple(
        LayerEntry(i, f"model.layers.{i}.self_attn.attn", attention)
        if i % period == offset
        else LayerEntry(i, f"model.layers.{i}.mamba", mamba)
        for i in range(n)
    )
    return ModelLayers(str(cfg["model_type"]), n, entries)


def _whisper(cfg: dict[str, Any], options: ModelSpecOptions, family: str) -> ModelLayers:
    if options.pp > 1:
        raise InvalidArgument("pp", "whisper does not support pipeline parallelism")
    n = require_int(cfg, "decoder_layers")
    heads = require_int(cfg, "decoder_attention_heads")
    d_model = require_int(cfg, "d_model")
    if d_model % heads:
        raise InvalidArgument("d_model", f"{d_model} is not divisible by {heads} heads")
    kv_heads = kv_heads_per_rank(heads, heads, options.tp)
    head_size = d_model // heads
    dtype, mode = _kv_storage(options, model_dtype(cfg, options.dtype), mla=False)
    common: dict[str, Any] = {
        "block_size": options.block_size,
        "num_kv_heads": kv_heads,
        "head_size": head_size,
        "dtype": dtype,
        "kv_quant_mode": mode,
    }
    self_attn = FullAttentionSpec(**common)
    cross_attn = CrossAttentionSpec(**common)
    # The encoder's self-attention is recomputed from the audio features; it has no cache.
    entries: list[LayerEntry] = []
    for i in range(n):
        entries.append(LayerEntry(i, f"model.decoder.layers.{i}.self_attn.attn", self_attn))
        entries.append(LayerEntry(i, f"model.decoder.layers.{i}.encoder_attn.attn", cross_attn))
    return ModelLayers(str(cfg["model_type"]), n, tuple(entries))


# model_type -> (family, builder)
_FAMILIES: dict[str, tuple[str, _Builder]] = {
    "llama": ("llama", _decoder_only),
    "mistral": ("mistral", _decoder_only),
    "mixtral": ("mistral", _decoder_only),
    "qwen2": ("qwen2", _decoder_only),
    "qwen2_moe": ("qwen2", _decoder_only),
    "qwen3": ("qwen3", _decoder_only),
    "qwen3_moe": ("qwen3", _decoder_only),
    "gemma": ("gemma", _decoder_only),
    "gemma2": ("gemma2", _decoder_only),
    "gemma3": ("gemma3", _decoder_only),
    "gemma3_text": ("gemma3", _decoder_only),
    "deepseek_v2": ("deepseek", _deepseek),
    "deepseek_v3": ("deepseek", _deepseek),
    "jamba": ("jamba", _jamba),
    "whisper": ("whisper", _whisper),
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


def _family_of(config: dict[str, Any]) -> tuple[str, _Builder]:
    model_type = config.get("model_type")
    try:
        return _FAMILIES[str(model_type)]
    except KeyError:
        raise InvalidArgument(
            "model_type",
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            " (or describe the layers in a spec file)",
        ) from None


def model_layers(config: dict[str, Any], options: ModelSpecOptions) -> ModelLayers:
    """Every cache-holding layer of the model with its spec on one TP rank (all alike)."""
    _family_of(config)  # a clear error before anything else for an unknown type
    cfg = text_config(config)
    if config.get("model_type") != cfg.get("model_type"):
        cfg["_wrapped"] = True  # a multimodal wrapper: vLLM prefixes "language_model."
    family, builder = _family_of(cfg)
    return builder(cfg, options, family)


def _partition(layers: ModelLayers, options: ModelSpecOptions) -> list[dict[str, KVCacheSpec]]:
    stages: list[dict[str, KVCacheSpec]] = []
    for pp_rank in range(options.pp):
        start, end = get_pp_indices(
            layers.num_layers, pp_rank, options.pp, options.pp_layer_partition
        )
        stages.append({e.name: e.spec for e in layers.entries if start <= e.index < end})
    return stages


def layer_specs_all_ranks(
    config: dict[str, Any], options: ModelSpecOptions
) -> list[dict[str, KVCacheSpec]]:
    """The ``{layer_name: spec}`` map of every rank, indexed ``pp_rank * tp + tp_rank``.

    Raises:
        InvalidArgument: for an unsupported model type or a config/parallelism mismatch.
    """
    stages = _partition(model_layers(config, options), options)
    return [dict(stages[rank // options.tp]) for rank in range(options.world_size)]


def layer_specs_for_rank(
    config: dict[str, Any], options: ModelSpecOptions, rank: int
) -> dict[str, KVCacheSpec]:
    """The ``{layer_name: spec}`` map of one global rank (``pp_rank * tp + tp_rank``).

    Raises:
        InvalidArgument: for a rank outside the world, or as :func:`layer_specs_all_ranks`.
    """
    if not 0 <= rank < options.world_size:
        raise InvalidArgument("rank", f"must be in [0, {options.world_size}), got {rank}")
    layers = model_layers(config, options)
    start, end = get_pp_indices(
        layers.num_layers, rank // options.tp, options.pp, options.pp_layer_partition
    )
    return {e.name: e.spec for e in layers.entries if start <= e.index < end}


def default_max_model_len(config: dict[str, Any]) -> int:
    """The model's own context limit: what ``max_model_len`` defaults to.

    ``max_position_embeddings`` for decoder-only models; the decoder's
    ``max_target_positions`` for Whisper.
    """
    cfg = text_config(config)
    if cfg.get("model_type") == "whisper":
        return require_int(cfg, "max_target_positions")
    return require_int(cfg, "max_position_embeddings")


def default_max_num_encoder_input_tokens(config: dict[str, Any]) -> int:
    """Longest encoder input per request (sizes cross-attention); 0 for decoder-only models.

    For Whisper it is the encoder's ``max_source_positions`` (1500 frames = 30 s of audio).
    """
    cfg = text_config(config)
    if cfg.get("model_type") == "whisper":
        return require_int(cfg, "max_source_positions")
    return 0


def total_num_kv_heads(config: dict[str, Any]) -> int | None:
    """KV heads of the whole model's attention layers (decides TP replicas); None for MLA."""
    cfg = text_config(config)
    family, _ = _family_of(cfg)
    if family == "deepseek":
        return None
    if family == "whisper":
        return require_int(cfg, "decoder_attention_heads")
    heads = require_int(cfg, "num_attention_heads")
    return int(cfg.get("num_key_value_heads") or heads)
