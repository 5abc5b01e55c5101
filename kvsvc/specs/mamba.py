"""The state-space (Mamba/SSM) spec kind: fixed-size state tensors per block.

Unlike attention, a Mamba layer's cache does not grow with the sequence: a request holds
one running state, or (for prefix caching) states at block boundaries; ``mamba_cache_mode``
says which, and so how many pages a request needs at its peak.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import ClassVar

from kvsvc.specs.base import KVCacheSpec, KVCacheSpecKind, SizingContext, cdiv
from kvsvc.specs.dtypes import dtype_size

MAMBA_CACHE_MODES = ("none", "align", "all")


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
