"""From a pool's registrations to its plan and its core cache: the planner's options, the
checks a plan must pass, and the :class:`~kvsvc.core.PoolKVCache` built from it with the
pool's bounds (``max_pool_tokens`` and ``max_unscheduled_tokens`` default from the plan).

Used when a pool is planned (every rank registered) and when a saved state is loaded (the
plan is made again from the saved registrations).
"""

from __future__ import annotations

from typing import Any

from kvsvc.errors import PlanningError, quoted
from kvsvc.server.config import PoolConfig
from kvsvc.server.registration import Registration

# max_pool_tokens's default: this many times the pool's KV capacity in tokens, or this many
# requests of max_model_len (vLLM's default max_num_seqs), whichever is larger.
DEFAULT_POOL_TOKENS_PER_CAPACITY = 4
DEFAULT_POOL_TOKENS_PER_MODEL_LEN = 256
# max_unscheduled_tokens's default: the pool's KV capacity in tokens, or this many prompts
# of max_model_len waiting for their chunks, whichever is larger.
DEFAULT_UNSCHEDULED_TOKENS_PER_MODEL_LEN = 16


def planner_options(config: PoolConfig, regs: list[Registration]) -> Any:
    """The planner's options for these registrations (rank order).

    Raises:
        PlanningError: no max_model_len from the config or the agents.
    """
    from kvsvc.planner import PlannerOptions

    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = regs[0].max_model_len
    if not max_model_len:
        raise PlanningError(
            f"pool {quoted(config.name)} has no max_model_len: set it in the pool config "
            "(or -1 to fit memory), or have the agents report the model's length"
        )
    return PlannerOptions(
        max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_encoder_input_tokens=regs[0].max_num_encoder_input_tokens,
        num_gpu_blocks_override=config.num_gpu_blocks_override,
        disable_hybrid_kv_cache_manager=config.disable_hybrid_kv_cache_manager,
        enable_prefix_caching=config.enable_prefix_caching,
        layout=config.layout,
        tensor_parallel_size=max(1, regs[0].tensor_parallel_size),
        # Auto-fit searches up to the model's own limit when the agents know it.
        derived_max_model_len=regs[0].max_model_len or None,
        total_num_kv_heads=regs[0].total_num_kv_heads or None,
    )


def check_plan_size(config: PoolConfig, plan: Any) -> None:
    """A plan above ``max_num_blocks`` fails before the manager builds its blocks."""
    limit = config.max_num_blocks
    if plan.num_blocks > limit:
        raise PlanningError(
            f"pool {quoted(config.name)}: the plan has {plan.num_blocks} blocks per rank, above "
            f"max_num_blocks={limit}; raise max_num_blocks or set "
            "num_gpu_blocks_override (or check the ranks' memory claims)"
        )


def build_pool_cache(config: PoolConfig, plan: Any) -> Any:
    """The pool's core cache for ``plan``, empty, with the pool's settings and bounds."""
    from kvsvc.core import PoolKVCache

    return PoolKVCache(
        plan.scheduler_config,
        max_model_len=plan.max_model_len,
        enable_caching=config.enable_prefix_caching,
        hash_algo=config.hash_algo,
        hash_seed=config.hash_seed,
        hash_block_size=plan.hash_block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_requests=config.max_requests,
        recently_freed=config.recently_freed,
        prefix_cache_retention_interval=(
            None
            if config.prefix_cache_retention_interval < 0
            else config.prefix_cache_retention_interval
        ),
        max_tokens=max_pool_tokens(config, plan),
        max_unscheduled_tokens=max_unscheduled_tokens(config, plan),
    )


def max_unscheduled_tokens(config: PoolConfig, plan: Any) -> int:
    """The pool's ``max_unscheduled_tokens``: configured, or its default."""
    if config.max_unscheduled_tokens is not None:
        return config.max_unscheduled_tokens
    capacity = max(plan.num_blocks - 1, 1) * plan.block_size
    return max(capacity, DEFAULT_UNSCHEDULED_TOKENS_PER_MODEL_LEN * plan.max_model_len)


def max_pool_tokens(config: PoolConfig, plan: Any) -> int:
    """The pool's ``max_pool_tokens``: configured, or its default (see PoolConfig)."""
    if config.max_pool_tokens is not None:
        return config.max_pool_tokens
    capacity = max(plan.num_blocks - 1, 1) * plan.block_size
    return max(
        DEFAULT_POOL_TOKENS_PER_CAPACITY * capacity,
        DEFAULT_POOL_TOKENS_PER_MODEL_LEN * plan.max_model_len,
    )
