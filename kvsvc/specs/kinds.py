"""KV cache spec types: what one layer needs per block, and how much a request can need.

Each spec is a frozen, hashable dataclass so the planner can bucket layers by equal specs.
The page arithmetic follows vLLM's ``kv_cache_interface`` exactly, because a worker that
allocates from the plan must find the same byte counts its attention backend expects.

Sizing a request (``max_memory_usage_bytes``) needs a few engine limits: they travel in a
:class:`SizingContext` instead of a whole engine config.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from math import prod
from typing import Any, ClassVar, TypeVar

from kvsvc.specs.dtypes import KVQuantMode, dtype_size, nvfp4_full_dim

_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")

# Bytes per token of DeepSeek's fp8_ds_mla row layouts.
FP8_DS_MLA_ROW_BYTES_V32 = 656  # 512 NoPE fp8 + 4 fp32 scales + 64 RoPE bf16
FP8_DS_MLA_ROW_BYTES_V4 = 584  # 448 NoPE + 128 RoPE + 8 scale bytes


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


class SpecMergeError(ValueError):
    """Layers that must share one block table disagree on their spec."""


class KVCacheSpecKind(StrEnum):
    """The attention kind of a spec, as reported to users and routers."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


MAMBA_CACHE_MODES = ("none", "align", "all")


@dataclass(frozen=True, slots=True)
class SizingContext:
    """Engine limits that decide how many blocks one request may hold.

    Attributes:
        max_model_len: longest sequence (prompt + output) a request may reach.
        max_num_batched_tokens: tokens scheduled but not yet settled (one step's budget);
            bounds what a sliding-window or chunked-local layer holds beyond its window.
        max_num_encoder_input_tokens: longest encoder input (cross-attention sizing).
        dcp_world_size: decode-context-parallel shards a full-attention KV is split over.
    """

    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_encoder_input_tokens: int = 0
    dcp_world_size: int = 1

    def with_max_model_len(self, max_model_len: int) -> SizingContext:
        return replace(self, max_model_len=max_model_len)


def _mismatch_error(
    what: str, specs: Sequence[KVCacheSpec], names: Sequence[str] | None, attr: str
) -> SpecMergeError:
    labels = list(names) if names is not None else [f"#{i}" for i in range(len(specs))]
    first_value = getattr(specs[0], attr, None)
    for label, spec in zip(labels, specs, strict=False):
        value = getattr(spec, attr, None)
        if value != first_value:
            return SpecMergeError(
                f"{what}: layer {label} has {attr}={value!r} but layer {labels[0]} has "
                f"{attr}={first_value!r}"
            )
    return SpecMergeError(f"{what}: layers disagree on {attr}")


def _require_same(
    what: str, specs: Sequence[KVCacheSpec], names: Sequence[str] | None, attrs: Iterable[str]
) -> None:
    for attr in attrs:
        values = {getattr(spec, attr, None) for spec in specs}
        if len(values) > 1:
            raise _mismatch_error(what, specs, names, attr)


def _require_type(
    what: str, specs: Sequence[KVCacheSpec], names: Sequence[str] | None, cls: type
) -> None:
    labels = list(names) if names is not None else [f"#{i}" for i in range(len(specs))]
    for label, spec in zip(labels, specs, strict=False):
        if not isinstance(spec, cls):
            raise SpecMergeError(
                f"{what}: layer {label} is {type(spec).__name__}, expected {cls.__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The cache format of one layer: ``block_size`` tokens per page."""

    block_size: int

    # Name used in JSON and protobuf for this concrete type (distinct from ``kind``:
    # a hidden-state layer is of kind mla_attention but must round-trip as itself).
    type_name: ClassVar[str] = "abstract"

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def real_page_size_bytes(self) -> int:
        return self.page_size_bytes

    @property
    def storage_block_size(self) -> int:
        """Token slots a page physically stores (smaller than block_size when compressed)."""
        return self.block_size

    @property
    def participates_in_prefix_caching(self) -> bool:
        return True

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.UNKNOWN

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        """Bytes one request of ``ctx.max_model_len`` tokens may hold at its peak."""
        raise NotImplementedError

    def max_num_blocks_per_req(self, ctx: SizingContext, max_len: int) -> int:
        """Block-table row length needed for a request of ``max_len`` tokens."""
        return cdiv(max_len, self.block_size)

    def copy_with_new_block_size(self: _SpecT, block_size: int) -> _SpecT:
        return replace(self, block_size=block_size)

    @classmethod
    def merge(
        cls: type[_SpecT], specs: Sequence[_SpecT], names: Sequence[str] | None = None
    ) -> _SpecT:
        """Merge the specs of layers that will share one block table.

        Raises:
            SpecMergeError: naming the layers that disagree and the field they disagree on.
        """
        for spec in specs[1:]:
            if spec != specs[0]:
                diff = next(
                    (
                        f.name
                        for f in fields(spec)
                        if getattr(spec, f.name, None) != getattr(specs[0], f.name, None)
                    ),
                    "type",
                )
                if type(spec) is not type(specs[0]):
                    _require_type(
                        "layers in one KV cache group must be the same type",
                        specs,
                        names,
                        type(specs[0]),
                    )
                raise _mismatch_error(
                    "all layers in one KV cache group must have the same spec", specs, names, diff
                )
        return specs[0]

    def uniform_type_base(self) -> type[KVCacheSpec]:
        """The class whose instances need the same token slots as this spec."""
        return type(self)

    def is_uniform_with_collection(self, specs: Iterable[KVCacheSpec]) -> bool:
        """Whether every spec needs the same number of token slots per request as this one."""
        base = self.uniform_type_base()
        return all(isinstance(spec, base) for spec in specs)


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
        _require_type(what, specs, names, FullAttentionSpec)
        for label, spec in zip(names or [f"#{i}" for i in range(len(specs))], specs, strict=False):
            if isinstance(spec, MLAAttentionSpec):
                raise SpecMergeError(
                    f"{what}: layer {label} is MLA and merges only with MLA layers"
                )
        _require_same(what, specs, names, (*_attention_fields(), "head_size_v"))
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


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
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
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        if self.compress_ratio < 1 or self.block_size % self.compress_ratio:
            raise ValueError(
                f"compress_ratio={self.compress_ratio} must be >= 1 and divide "
                f"block_size={self.block_size}"
            )
        _apply_alignment_padding(self)
        self._check_padding()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.MLA_ATTENTION

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        return _mla_page_bytes(self)

    @classmethod
    def merge(cls, specs, names=None):  # type: ignore[no-untyped-def,override]
        what = "layers in one MLA group"
        _require_type(what, specs, names, MLAAttentionSpec)
        _require_same(what, specs, names, (*_attention_fields(), *_MLA_SHARED_FIELDS, "alignment"))
        first = specs[0]
        return cls(
            block_size=first.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            kv_quant_mode=first.kv_quant_mode,
            page_size_padded=first.page_size_padded,
            indexes_kv_by_block_stride=first.indexes_kv_by_block_stride,
            cache_dtype_str=first.cache_dtype_str,
            alignment=first.alignment,
            compress_ratio=first.compress_ratio,
            model_version=first.model_version,
            non_causal=any(s.non_causal for s in specs),
        )


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
        _require_same("layers in one sink-attention group", specs, names, ("sink_len",))
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
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window attention over an MLA latent cache."""

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    type_name: ClassVar[str] = "sliding_window_mla"

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        if self.model_version not in (None, "deepseek_v4"):
            raise ValueError(
                f"unsupported model_version {self.model_version!r} for sliding-window MLA"
            )
        if self.compress_ratio < 1 or self.block_size % self.compress_ratio:
            raise ValueError(
                f"compress_ratio={self.compress_ratio} must be >= 1 and divide "
                f"block_size={self.block_size}"
            )
        _apply_alignment_padding(self)
        self._check_padding()

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.SLIDING_WINDOW_MLA

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def real_page_size_bytes(self) -> int:
        return _mla_page_bytes(self)

    @classmethod
    def merge(cls, specs, names=None):  # type: ignore[no-untyped-def,override]
        what = "layers in one sliding-window MLA group"
        _require_type(what, specs, names, SlidingWindowMLASpec)
        _require_same(
            what,
            specs,
            names,
            (*_attention_fields(), *_MLA_SHARED_FIELDS, "sliding_window", "alignment"),
        )
        first = specs[0]
        return cls(
            block_size=first.block_size,
            num_kv_heads=first.num_kv_heads,
            head_size=first.head_size,
            dtype=first.dtype,
            kv_quant_mode=first.kv_quant_mode,
            page_size_padded=first.page_size_padded,
            indexes_kv_by_block_stride=first.indexes_kv_by_block_stride,
            sliding_window=first.sliding_window,
            cache_dtype_str=first.cache_dtype_str,
            alignment=first.alignment,
            compress_ratio=first.compress_ratio,
            model_version=first.model_version,
        )

    def is_uniform_with_collection(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(s, SlidingWindowMLASpec) and s.sliding_window == self.sliding_window
            for s in specs
        )


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state (Mamba/SSM): fixed-size state tensors per block, whatever the length.

    ``mamba_cache_mode``: ``none`` keeps one state per request, ``align`` keeps the state at
    block boundaries for prefix caching (two live), ``all`` keeps one per block.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0

    type_name: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"mamba spec has {len(self.shapes)} state shapes but {len(self.dtypes)} dtypes"
            )
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"unknown mamba_cache_mode {self.mamba_cache_mode!r}; valid: "
                + ", ".join(MAMBA_CACHE_MODES)
            )
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the mamba state "
                f"({self.real_page_size_bytes} bytes)"
            )

    @property
    def kind(self) -> KVCacheSpecKind:
        return KVCacheSpecKind.MAMBA

    @property
    def real_page_size_bytes(self) -> int:
        return sum(
            prod(shape) * dtype_size(dt) for shape, dt in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        if self.mamba_cache_mode == "all":
            return (
                cdiv(ctx.max_model_len, self.block_size) + self.num_speculative_blocks
            ) * self.page_size_bytes
        if self.mamba_cache_mode == "align":
            return (2 + self.num_speculative_blocks) * self.page_size_bytes
        return (1 + self.num_speculative_blocks) * self.page_size_bytes

    def max_num_blocks_per_req(self, ctx: SizingContext, max_len: int) -> int:
        if self.mamba_cache_mode == "align":
            # Rows are indexed by position over the whole sequence even though only a few
            # state blocks are live (earlier ones become the null block).
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return cdiv(
            self.max_memory_usage_bytes(ctx.with_max_model_len(max_len)), self.page_size_bytes
        )

    def is_uniform_with_collection(self, specs: Iterable[KVCacheSpec]) -> bool:
        return all(
            isinstance(s, MambaSpec) and s.num_speculative_blocks == self.num_speculative_blocks
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


@dataclass(frozen=True, kw_only=True, eq=False)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers that need the same token slots but differ in page size, kept in one group.

    The group's page is the sum of its layers' pages: one block id addresses one page in
    every member layer.
    """

    kv_cache_specs: dict[str, KVCacheSpec] = field(default_factory=dict)

    type_name: ClassVar[str] = "uniform_type"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, UniformTypeKVCacheSpecs):
            return NotImplemented
        return self.block_size == other.block_size and self.kv_cache_specs == other.kv_cache_specs

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def kind(self) -> KVCacheSpecKind:
        kinds = {spec.kind for spec in self.kv_cache_specs.values()}
        if len(kinds) == 1:
            return next(iter(kinds))
        if all(isinstance(s, FullAttentionSpec) for s in self.kv_cache_specs.values()):
            return KVCacheSpecKind.FULL_ATTENTION
        return KVCacheSpecKind.UNKNOWN

    @property
    def participates_in_prefix_caching(self) -> bool:
        return all(s.participates_in_prefix_caching for s in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_pages(self, ctx: SizingContext) -> int:
        return max(
            cdiv(spec.max_memory_usage_bytes(ctx), spec.page_size_bytes)
            for spec in self.kv_cache_specs.values()
        )

    def max_memory_usage_bytes(self, ctx: SizingContext) -> int:
        return self.max_memory_usage_pages(ctx) * self.page_size_bytes

    def max_num_blocks_per_req(self, ctx: SizingContext, max_len: int) -> int:
        widths = {s.max_num_blocks_per_req(ctx, max_len) for s in self.kv_cache_specs.values()}
        if len(widths) != 1:
            raise ValueError(
                f"layers in one KV cache group need different block-table widths: {sorted(widths)}"
            )
        return next(iter(widths))

    def get_page_sizes(self) -> list[int]:
        return sorted({spec.page_size_bytes for spec in self.kv_cache_specs.values()})

    def get_max_layers_per_page_size(self) -> int:
        """Layers of the most common page size (the repeat count of a 1:1 layer pattern)."""
        return Counter(s.page_size_bytes for s in self.kv_cache_specs.values()).most_common(1)[0][1]

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size=block_size,
            kv_cache_specs={
                name: spec.copy_with_new_block_size(block_size)
                for name, spec in self.kv_cache_specs.items()
            },
        )

    @classmethod
    def is_uniform_type(cls, specs: dict[str, KVCacheSpec]) -> bool:
        """Whether all layers share a block size and need the same token slots."""
        if not specs:
            return False
        if len({spec.block_size for spec in specs.values()}) > 1:
            return False
        first = next(iter(specs.values()))
        return first.is_uniform_with_collection(specs.values())

    @classmethod
    def from_specs(cls, specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        if not cls.is_uniform_type(specs):
            return None
        return cls(block_size=next(iter(specs.values())).block_size, kv_cache_specs=dict(specs))


def iter_layer_specs(spec: KVCacheSpec) -> Iterable[KVCacheSpec]:
    """The per-layer specs behind a group spec (itself unless it is a uniform-type bundle)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs.values()
    return (spec,)


def sliding_window_of(spec: KVCacheSpec) -> int | None:
    """The sliding window a group spec drops blocks by, if it does."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        windows = {sliding_window_of(s) for s in spec.kv_cache_specs.values()}
        return next(iter(windows)) if len(windows) == 1 else None
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    return None


def merge_layer_specs(named_specs: dict[str, KVCacheSpec]) -> KVCacheSpec:
    """Merge the specs of the named layers into the one spec their group uses.

    Raises:
        SpecMergeError: naming the first pair of layers that disagree and on what.
    """
    if not named_specs:
        raise ValueError("cannot merge an empty set of layer specs")
    names = list(named_specs)
    specs = list(named_specs.values())
    return type(specs[0]).merge(specs, names)


SPEC_TYPES: dict[str, type[KVCacheSpec]] = {
    cls.type_name: cls
    for cls in (
        FullAttentionSpec,
        MLAAttentionSpec,
        HiddenStateCacheSpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
        SlidingWindowMLASpec,
        ChunkedLocalAttentionSpec,
        MambaSpec,
        EncoderOnlyAttentionSpec,
        CrossAttentionSpec,
        UniformTypeKVCacheSpecs,
    )
}
