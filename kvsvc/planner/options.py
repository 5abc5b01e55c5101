"""What the engine told us about itself, as the planner needs it."""

from __future__ import annotations

from dataclasses import dataclass

from kvsvc.errors import InvalidArgument

LAYER_OUTER = "layer_outer"
BLOCK_OUTER = "block_outer"
LAYOUTS: tuple[str, ...] = (LAYER_OUTER, BLOCK_OUTER)

AUTO_FIT = -1
# Where auto-fit starts its search when the model's own limit is unknown (a spec file):
# the largest position a 32-bit position id can hold.
AUTO_FIT_CAP = 2**31 - 1
# Scheduler block size of a model without any KV cache (vLLM's default block size).
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class PlannerOptions:
    """Engine settings that shape the plan.

    Attributes:
        max_model_len: longest request (prompt + output) to admit; ``-1`` auto-fits the
            largest length the memory holds, up to ``derived_max_model_len``.
        max_num_batched_tokens: tokens one step may schedule: what a sliding-window or
            chunked-local layer holds beyond its window.
        max_num_encoder_input_tokens: longest encoder input (cross-attention layers); see
            :func:`kvsvc.models.default_max_num_encoder_input_tokens`.
        num_gpu_blocks_override: use exactly this many blocks per worker, whatever the
            memory (the capacity check then uses it too).
        disable_hybrid_kv_cache_manager: one block table for all layers; local-attention
            layers are allocated as full attention (they still compute locally).
        enable_prefix_caching: whether block hashes are used; decides the hash block size.
        prefix_match_unit: hash granularity for multi-group models (default: the gcd of the
            group block sizes); must divide every prefix-cacheable group's block size.
        layout: ``layer_outer`` (one tensor per layer slot, vLLM's classic layout) or
            ``block_outer`` (one packed backing, every layer's page side by side in a
            block). Layers whose pages cannot be brought to one size (e.g. MLA next to a
            smaller sparse indexer) need ``block_outer``; the planner does not switch
            layouts behind the engine's back, because the layout is a contract with its
            attention backends. It says so in the error instead.
        tensor_parallel_size: TP degree, for the TP replica count.
        dcp_world_size: decode-context-parallel degree (full-attention KV sharded by token).
        derived_max_model_len: the model's own context limit: the upper end of the
            auto-fit search (default ``AUTO_FIT_CAP``).
        total_num_kv_heads: the model's KV heads before the TP split; lets the planner
            report TP replicas for attention layers replicated over TP (MLA is always
            replicated and needs no hint).
    """

    max_model_len: int
    max_num_batched_tokens: int = 8192
    max_num_encoder_input_tokens: int = 0
    num_gpu_blocks_override: int | None = None
    disable_hybrid_kv_cache_manager: bool = False
    enable_prefix_caching: bool = True
    prefix_match_unit: int | None = None
    layout: str = LAYER_OUTER
    tensor_parallel_size: int = 1
    dcp_world_size: int = 1
    derived_max_model_len: int | None = None
    total_num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.max_model_len != AUTO_FIT and self.max_model_len < 1:
            raise InvalidArgument(
                "max_model_len",
                f"must be a positive integer or -1 (auto-fit), got {self.max_model_len}",
            )
        positive = ("max_num_batched_tokens", "tensor_parallel_size", "dcp_world_size")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise InvalidArgument(name, f"must be >= 1, got {value}")
        if self.max_num_encoder_input_tokens < 0:
            raise InvalidArgument(
                "max_num_encoder_input_tokens",
                f"must be >= 0, got {self.max_num_encoder_input_tokens}",
            )
        optional = (
            "num_gpu_blocks_override",
            "prefix_match_unit",
            "derived_max_model_len",
            "total_num_kv_heads",
        )
        for name in optional:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgument(name, f"must be a positive integer when set, got {value}")
        if self.layout not in LAYOUTS:
            raise InvalidArgument(
                "layout", f"unknown layout {self.layout!r}; valid: {', '.join(LAYOUTS)}"
            )

    @property
    def auto_fit(self) -> bool:
        return self.max_model_len == AUTO_FIT
