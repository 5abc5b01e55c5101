"""What every KV cache spec kind shares: the base class, the sizing context, merge rules.

Each spec is a frozen, hashable dataclass so the planner can bucket layers by equal specs.
The page arithmetic follows vLLM's ``kv_cache_interface`` exactly, because a worker that
allocates from the plan must find the same byte counts its attention backend expects.

Sizing a request (``max_memory_usage_bytes``) needs a few engine limits: they travel in a
:class:`SizingContext` instead of a whole engine config. Layers that share one block table
merge into one spec (``KVCacheSpec.merge``); the checks here name the first layers that
disagree and on what. The kinds themselves: :mod:`kvsvc.specs.attention` and
:mod:`kvsvc.specs.mamba`; groups and the catalogue of kinds: :mod:`kvsvc.specs.kinds`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import ClassVar, TypeVar

_SpecT = TypeVar("_SpecT", bound="KVCacheSpec")


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def round_up(value: int, multiple: int) -> int:
    return cdiv(value, multiple) * multiple


class SpecMergeError(ValueError):
    """Layers that must share one block table disagree on their spec."""


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


def mismatch_error(
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


def require_same(
    what: str, specs: Sequence[KVCacheSpec], names: Sequence[str] | None, attrs: Iterable[str]
) -> None:
    for attr in attrs:
        values = {getattr(spec, attr, None) for spec in specs}
        if len(values) > 1:
            raise mismatch_error(what, specs, names, attr)


def require_type(
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
                    require_type(
                        "layers in one KV cache group must be the same type",
                        specs,
                        names,
                        type(specs[0]),
                    )
                raise mismatch_error(
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
