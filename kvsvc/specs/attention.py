"""Attention spec kinds: keys and values (or an MLA latent) per token, per block.

Full attention and its refinements (MLA, hidden-state caches, attention sinks), the
windowed kinds (sliding window, its MLA form, chunked local) and the kinds that never
share blocks (encoder-only, cross attention): their page sizes, their per-request peaks
and the rules by which layers of one group merge.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, cast

from kvsvc.specs.base import (
    KVCacheSpec,
    KVCacheSpecKind,
    SizingContext,
    SpecMergeError,
    cdiv,
    require_same,
    require_type,
    round_up,
)
from kvsvc.specs.dtypes import KVQuantMode, dtype_size, nvfp4_full_dim

# Bytes per token of DeepSeek's fp8_ds_mla row layouts.
FP8_DS_MLA_ROW_BYTES_V32 = 656  # 512 NoPE fp8 + 4 fp32 scales + 64 RoPE bf16
FP8_DS_MLA_ROW_BYTES_V4 = 584  # 448 NoPE + 128 RoPE + 8 scale bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A layer that caches keys and values for ``num_kv_heads`` heads of ``head_size``."""

    num_kv_heads: int
    head_size: int
    dtype: str
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    indexes_kv_by_block_stride: bool = False

    @property
    def real_page_size_bytes(self) -> int:
        if self.kv_quant_mode.is_nvfp4:
            head_dim = nvfp4_full_dim(self.head_size)
        elif self.kv_quant_mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
            head_dim = self.head_size // 2
        else:
            head_dim = self.head_size
        return 2 * self.block_size * self.num_kv_heads * head_dim * dtype_size(self.dtype)

    @property
    def unpadded_page_size_bytes(self) -> int:
        unpadded = self.real_page_size_bytes
        if self.kv_quant_mode.is_per_token_head:
            # One fp32 scale per token and head, for K and for V, carved from the same
            # raw allocation as the values, so the page must budget for it.
            unpadded += 2 * self.block_size * self.num_kv_heads * 4
        return unpadded

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    def max_num_blocks_per_req(self, ctx: SizingContext, max_len: int) -> int:
        return cdiv(max_len, self.block_size * ctx.dcp_world_size)

    def _check_padding(self) -> None:
        if (
            self.page_size_padded is not None
            and self.page_size_padded < self.unpadded_page_size_bytes
        ):
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the real page "
                f"({self.unpadded_page_size_bytes} bytes)"
            )


def _attention_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(AttentionSpec))


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Attention over every past token; blocks are kept for the whole request.

    ``sliding_window`` / ``attention_chunk_size`` are set when the hybrid manager is off and
    a local-attention layer was promoted to full allocation: it still computes locally.
    """

    head_size_v: int = None  # type: ignore[assignment]  # defaults to head_size
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    type_name: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        self._check_padding()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.FULL_ATTENTION

    @property
    def real_page_size_bytes(self) -> int:
        if self.kv_quant_mode.is_nvfp4:
            last_dim = nvfp4_full_dim(self.head_size) + nvfp4_full_dim(self.head_size_v)
        elif self.kv_quant_mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
            last_dim = self.head_size // 2 + self.head_size_v // 2
        else:
            last_dim = self.head_size + self.head_size_v
        return self.block_size * self.num_kv_heads * last_dim * dtype_size(self.dtype)

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        max_len = ctx.max_model_len
        if ctx.dcp_world_size > 1:
            max_len = cdiv(max_len, ctx.dcp_world_size)
        return cdiv(max_len, self.block_size) * self.page_size_bytes

    def uniform_type_base(self) -> type[KVCacheSpec]:
        return FullAttentionSpec

    @staticmethod
    def merge_window_sizes(window_sizes: set[int], what: str = "window size") -> int | None:
        if not window_sizes:
            return None
        if len(window_sizes) == 1:
            return next(iter(window_sizes))
        raise SpecMergeError(
            f"all attention layers in one KV cache group must have the same {what}; "
            f"got {sorted(window_sizes)}"
        )

    @classmethod
    def merge(cls, specs, names=None):  # type: ignore[no-untyped-def,override]
        what = "layers in one full-attention group"
        require_type(what, specs, names, FullAttentionSpec)
        for label, spec in zip(names or [f"#{i}" for i in range(len(specs))], specs, strict=False):
            if isinstance(spec, MLAAttentionSpec):
                raise SpecMergeError(
                    f"{what}: layer {label} is MLA and merges only with MLA layers"
                )
        require_same(what, specs, names, (*_attention_fields(), "head_size_v"))
        extra = cls._merge_extra_fields(specs, names)
        merged = cls(
            block_size=specs[0].block_size,
            num_kv_heads=specs[0].num_kv_heads,
            head_size=specs[0].head_size,
            head_size_v=specs[0].head_size_v,
            dtype=specs[0].dtype,
            kv_quant_mode=specs[0].kv_quant_mode,
            page_size_padded=specs[0].page_size_padded,
            indexes_kv_by_block_stride=specs[0].indexes_kv_by_block_stride,
            sliding_window=cls.merge_window_sizes(
                {s.sliding_window for s in specs if s.sliding_window is not None}, "sliding window"
            ),
            attention_chunk_size=cls.merge_window_sizes(
                {s.attention_chunk_size for s in specs if s.attention_chunk_size is not None},
                "attention chunk size",
            ),
            # One non-causal layer makes the group non-causal: the engine must then avoid
            # scheduling features that assume causality.
            non_causal=any(s.non_causal for s in specs),
            **extra,
        )
        if merged.sliding_window is not None and merged.attention_chunk_size is not None:
            raise SpecMergeError(
                "a model with both sliding-window and chunked-local attention layers cannot "
                "share one full-attention group"
            )
        return merged

    @classmethod
    def _merge_extra_fields(cls, specs, names) -> dict[str, Any]:  # type: ignore[no-untyped-def]
        return {}


def _apply_alignment_padding(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> None:
    if spec.alignment is None:
        return
    real = spec.real_page_size_bytes
    padded = round_up(real, spec.alignment)
    if spec.page_size_padded is not None and spec.page_size_padded >= padded:
        return  # a larger page set on purpose (page-size unification) stays
    # Otherwise recompute: a padding carried over by ``replace`` (a new block size) is stale.
    object.__setattr__(spec, "page_size_padded", padded if padded != real else None)


def _mla_page_bytes(spec: MLAAttentionSpec | SlidingWindowMLASpec) -> int:
    if spec.cache_dtype_str == "fp8_ds_mla":
        if spec.model_version == "deepseek_v4":
            return spec.storage_block_size * FP8_DS_MLA_ROW_BYTES_V4
        if isinstance(spec, SlidingWindowMLASpec):
            raise ValueError("fp8_ds_mla sliding-window MLA layers exist only for deepseek_v4")
        return spec.block_size * FP8_DS_MLA_ROW_BYTES_V32
    head_dim = spec.head_size
    if spec.kv_quant_mode is KVQuantMode.INT4_PER_TOKEN_HEAD:
        head_dim //= 2
    # MLA caches one latent vector per token (no separate K and V).
    return spec.storage_block_size * spec.num_kv_heads * head_dim * dtype_size(spec.dtype)


_MLA_SHARED_FIELDS = (
    "cache_dtype_str",
    "compress_ratio",
    "model_version",
    "indexes_kv_by_block_stride",
)


def _values_of(spec: KVCacheSpec, names: Iterable[str]) -> dict[str, Any]:
    """The values of ``names`` in ``spec``: a merged spec takes what its layers share
    (``require_same`` has checked they agree)."""
    return {name: getattr(spec, name) for name in dict.fromkeys(names)}


class _LatentPages:
    """The page of an MLA latent cache, for MLA and its sliding-window form alike.

    One compressed latent row per token, ``block_size // compress_ratio`` rows a page,
    padded up to ``alignment`` (DeepSeek V4). The two spec kinds descend from different
    attention kinds (as in vLLM), so what they share about their pages lives here.
    """

    def _check_latent(self) -> None:
        """Fill ``head_size_v`` and the alignment padding, and refuse bad sizes; run by
        ``__post_init__`` once the fields are set."""
        spec = cast("MLAAttentionSpec | SlidingWindowMLASpec", self)
        if spec.head_size_v is None:
            object.__setattr__(spec, "head_size_v", spec.head_size)
        if spec.compress_ratio < 1 or spec.block_size % spec.compress_ratio:
            raise ValueError(
                f"compress_ratio={spec.compress_ratio} must be >= 1 and divide "
                f"block_size={spec.block_size}"
            )
        _apply_alignment_padding(spec)
        spec._check_padding()

    @property
    def storage_block_size(self) -> int:
        spec = cast("MLAAttentionSpec | SlidingWindowMLASpec", self)
        return spec.block_size // spec.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        return _mla_page_bytes(cast("MLAAttentionSpec | SlidingWindowMLASpec", self))


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(_LatentPages, FullAttentionSpec):
    """Multi-head latent attention: one compressed latent row per token.

    ``compress_ratio`` > 1 stores ``block_size // compress_ratio`` rows per page;
    ``alignment`` pads each page up to a multiple (DeepSeek V4).
    """

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    type_name: ClassVar[str] = "mla_attention"

    def __post_init__(self) -> None:
        self._check_latent()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.MLA_ATTENTION

    @classmethod
    def merge(cls, specs, names=None):  # type: ignore[no-untyped-def,override]
        what = "layers in one MLA group"
        require_type(what, specs, names, MLAAttentionSpec)
        shared = (*_attention_fields(), *_MLA_SHARED_FIELDS, "alignment")
        require_same(what, specs, names, shared)
        return cls(**_values_of(specs[0], shared), non_causal=any(s.non_causal for s in specs))


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Layers that store hidden states in the KV cache (hidden-state extraction)."""

    type_name: ClassVar[str] = "hidden_state"


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` attention-sink tokens held by every request."""

    sink_len: int | None = None

    type_name: ClassVar[str] = "sink_full_attention"

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.SINK_FULL_ATTENTION

    @classmethod
    def _merge_extra_fields(cls, specs, names) -> dict[str, Any]:  # type: ignore[no-untyped-def]
        require_same("layers in one sink-attention group", specs, names, ("sink_len",))
        return {"sink_len": specs[0].sink_len}


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4 local)."""

    attention_chunk_size: int

    type_name: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        self._check_padding()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        # A chunk's window plus the tokens in flight; blocks before the chunk are freed
        # only once the tokens that need them are processed.
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        blocks = self.max_admission_blocks_per_request(
            ctx.max_num_batched_tokens, ctx.max_model_len
        )
        return blocks * self.page_size_bytes

    def is_uniform_with_collection(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(s, ChunkedLocalAttentionSpec)
            and s.attention_chunk_size == self.attention_chunk_size
            for s in specs
        )


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens; older blocks can be dropped."""

    sliding_window: int
    head_size_v: int = None  # type: ignore[assignment]

    type_name: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        self._check_padding()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.SLIDING_WINDOW

    @property
    def real_page_size_bytes(self) -> int:
        if self.kv_quant_mode.is_nvfp4:
            last_dim = nvfp4_full_dim(self.head_size) + nvfp4_full_dim(self.head_size_v)
        else:
            last_dim = self.head_size + self.head_size_v
        return self.block_size * self.num_kv_heads * last_dim * dtype_size(self.dtype)

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        # +1: the window need not start on a block boundary. Block size 4, window 4 plus
        # two new tokens -> [xxCD][EF] spans two blocks for the six tokens CDEF.
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        if ctx.dcp_world_size != 1:
            raise ValueError("decode context parallelism does not support sliding-window layers")
        blocks = self.max_admission_blocks_per_request(
            ctx.max_num_batched_tokens, ctx.max_model_len
        )
        return blocks * self.page_size_bytes

    def is_uniform_with_collection(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(s, SlidingWindowSpec) and s.sliding_window == self.sliding_window
            for s in specs
        )


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(_LatentPages, SlidingWindowSpec):
    """Sliding-window attention over an MLA latent cache."""

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    type_name: ClassVar[str] = "sliding_window_mla"

    def __post_init__(self) -> None:
        if self.model_version not in (None, "deepseek_v4"):
            raise ValueError(
                f"unsupported model_version {self.model_version!r} for sliding-window MLA"
            )
        self._check_latent()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.SLIDING_WINDOW_MLA

    @classmethod
    def merge(cls, specs, names=None):  # type: ignore[no-untyped-def,override]
        what = "layers in one sliding-window MLA group"
        require_type(what, specs, names, SlidingWindowMLASpec)
        shared = (*_attention_fields(), *_MLA_SHARED_FIELDS, "sliding_window", "alignment")
        require_same(what, specs, names, shared)
        return cls(**_values_of(specs[0], shared))

    def is_uniform_with_collection(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(s, SlidingWindowMLASpec) and s.sliding_window == self.sliding_window
            for s in specs
        )


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder attention: computed once per step, nothing to cache."""

    type_name: ClassVar[str] = "encoder_only_attention"

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.ENCODER_ONLY_ATTENTION

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        return 0


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder attention over encoder states: sized by the encoder input, never shared."""

    type_name: ClassVar[str] = "cross_attention"

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.CROSS_ATTENTION

    @property
    def participates_in_prefix_caching(self) -> bool:
        return False

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        return cdiv(ctx.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes
