"""KV cache specs: per-layer cache formats, their page arithmetic, and the plan types.

Pure Python: no torch, no gRPC. The worker maps dtype names to torch; the server maps
these types to protobuf in :mod:`kvsvc.convert`.
"""

from kvsvc.specs.attention import (
    FP8_DS_MLA_ROW_BYTES_V4,
    FP8_DS_MLA_ROW_BYTES_V32,
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from kvsvc.specs.base import (
    KVCacheSpec,
    KVCacheSpecKind,
    SizingContext,
    SpecMergeError,
    cdiv,
    round_up,
)
from kvsvc.specs.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvsvc.specs.dtypes import (
    DTYPE_SIZES,
    KV_CACHE_DTYPE_CHOICES,
    KVQuantMode,
    canonical_dtype,
    dtype_size,
    nvfp4_full_dim,
    resolve_kv_cache_dtype,
)
from kvsvc.specs.kinds import (
    SPEC_TYPES,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
    merge_layer_specs,
    sliding_window_of,
)
from kvsvc.specs.mamba import MAMBA_CACHE_MODES, MambaSpec
from kvsvc.specs.serde import config_from_dict, config_to_dict, spec_from_dict, spec_to_dict

__all__ = [
    "DTYPE_SIZES",
    "FP8_DS_MLA_ROW_BYTES_V4",
    "FP8_DS_MLA_ROW_BYTES_V32",
    "KV_CACHE_DTYPE_CHOICES",
    "MAMBA_CACHE_MODES",
    "SPEC_TYPES",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "HiddenStateCacheSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheSpecKind",
    "KVCacheTensor",
    "KVQuantMode",
    "MLAAttentionSpec",
    "MambaSpec",
    "SinkFullAttentionSpec",
    "SizingContext",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "SpecMergeError",
    "UniformTypeKVCacheSpecs",
    "canonical_dtype",
    "cdiv",
    "config_from_dict",
    "config_to_dict",
    "dtype_size",
    "iter_layer_specs",
    "merge_layer_specs",
    "nvfp4_full_dim",
    "resolve_kv_cache_dtype",
    "round_up",
    "sliding_window_of",
    "spec_from_dict",
    "spec_to_dict",
]
