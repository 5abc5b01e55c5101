"""Element types and KV-cache quantisation modes, without torch.

The scheduler side (server, planner) must size pages exactly as the worker will allocate
them, but it must not import torch. Dtypes are therefore carried as the canonical torch
names (``"bfloat16"``, ``"float8_e4m3fn"``, ...) and sized from this table; the worker maps
the same names back to ``torch.dtype`` objects.
"""

from __future__ import annotations

from enum import IntEnum

# Bytes per element, keyed by the canonical torch dtype name.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Spellings users and Hugging Face configs use for the same types.
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "double": "float64",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def canonical_dtype(name: str) -> str:
    """Return the canonical dtype name for ``name`` (accepts ``torch.`` prefixes and aliases).

    Raises:
        ValueError: naming the unknown dtype and the valid ones.
    """
    key = name.removeprefix("torch.").strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_SIZES:
        valid = ", ".join(sorted(DTYPE_SIZES))
        raise ValueError(f"unknown dtype {name!r}; valid dtypes: {valid}")
    return key


def dtype_size(name: str) -> int:
    """Bytes per element of a canonical dtype name."""
    try:
        return DTYPE_SIZES[name]
    except KeyError:
        return DTYPE_SIZES[canonical_dtype(name)]


class KVQuantMode(IntEnum):
    """How a quantised KV cache stores its values; each mode changes the page arithmetic."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4  # two int4 values per byte
    NVFP4 = 5  # packed fp4 data plus fp8 block scales

    @property
    def is_per_token_head(self) -> bool:
        return self in (
            KVQuantMode.INT8_PER_TOKEN_HEAD,
            KVQuantMode.FP8_PER_TOKEN_HEAD,
            KVQuantMode.INT4_PER_TOKEN_HEAD,
        )

    @property
    def is_nvfp4(self) -> bool:
        return self is KVQuantMode.NVFP4


# kv-cache dtype flag -> (storage dtype, quant mode). "auto" means the model dtype.
_KV_CACHE_DTYPES: dict[str, tuple[str, KVQuantMode]] = {
    "fp8": ("float8_e4m3fn", KVQuantMode.FP8_PER_TENSOR),
    "fp8_e4m3": ("float8_e4m3fn", KVQuantMode.FP8_PER_TENSOR),
    "fp8_e5m2": ("float8_e5m2", KVQuantMode.FP8_PER_TENSOR),
    "fp8_ds_mla": ("uint8", KVQuantMode.FP8_PER_TENSOR),
    "int8_per_token_head": ("int8", KVQuantMode.INT8_PER_TOKEN_HEAD),
    "fp8_per_token_head": ("float8_e4m3fn", KVQuantMode.FP8_PER_TOKEN_HEAD),
    "int4_per_token_head": ("uint8", KVQuantMode.INT4_PER_TOKEN_HEAD),
    "nvfp4": ("uint8", KVQuantMode.NVFP4),
    "bfloat16": ("bfloat16", KVQuantMode.NONE),
    "float16": ("float16", KVQuantMode.NONE),
    "float32": ("float32", KVQuantMode.NONE),
}

KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = ("auto", *_KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> tuple[str, KVQuantMode]:
    """Map a ``--kv-cache-dtype`` value to the element type pages are stored in and its mode.

    Raises:
        ValueError: for an unknown value, listing the valid ones.
    """
    if kv_cache_dtype == "auto":
        return canonical_dtype(model_dtype), KVQuantMode.NONE
    try:
        return _KV_CACHE_DTYPES[kv_cache_dtype]
    except KeyError:
        valid = ", ".join(KV_CACHE_DTYPE_CHOICES)
        raise ValueError(
            f"unknown kv-cache dtype {kv_cache_dtype!r}; valid values: {valid}"
        ) from None


def nvfp4_full_dim(head_size: int) -> int:
    """Bytes per head of an NVFP4 row: fp4 data (2 per byte) plus one fp8 scale per 16."""
    return head_size // 2 + head_size // 16
