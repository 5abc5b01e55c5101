"""The KV cache planner: from every rank's layer specs and memory to a plan for each rank.

Pure and synchronous (no torch, no gRPC): the server calls :func:`plan_kv_cache` once all
ranks of a pool have registered; ``kvsvc plan`` calls it with specs derived from a model
config. See :mod:`kvsvc.planner.plan` for the steps and :mod:`kvsvc.planner.grouping` for
the grouping rules.
"""

from kvsvc.planner.grouping import (
    PageSizeUnificationError,
    approximate_gcd,
    get_kv_cache_groups,
    is_kv_cache_spec_uniform,
    promote_local_kv_cache_specs,
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_spec_page_size,
)
from kvsvc.planner.layout import (
    allocated_bytes,
    kv_cache_config_from_groups,
    page_stride,
    project_groups_to_worker,
)
from kvsvc.planner.memory import (
    blocks_per_request,
    check_enough_memory,
    estimate_max_model_len,
    group_blocks_per_request,
    max_memory_usage_bytes,
    pool_bytes_per_block,
)
from kvsvc.planner.options import (
    AUTO_FIT,
    AUTO_FIT_CAP,
    BLOCK_OUTER,
    LAYER_OUTER,
    LAYOUTS,
    PlannerOptions,
)
from kvsvc.planner.plan import (
    KVCachePlan,
    max_concurrency,
    plan_kv_cache,
    resolve_block_sizes,
    scheduler_kv_cache_config,
    tp_replicas,
)

__all__ = [
    "AUTO_FIT",
    "AUTO_FIT_CAP",
    "BLOCK_OUTER",
    "LAYER_OUTER",
    "LAYOUTS",
    "KVCachePlan",
    "PageSizeUnificationError",
    "PlannerOptions",
    "allocated_bytes",
    "approximate_gcd",
    "blocks_per_request",
    "check_enough_memory",
    "estimate_max_model_len",
    "get_kv_cache_groups",
    "group_blocks_per_request",
    "is_kv_cache_spec_uniform",
    "kv_cache_config_from_groups",
    "max_concurrency",
    "max_memory_usage_bytes",
    "page_stride",
    "plan_kv_cache",
    "pool_bytes_per_block",
    "project_groups_to_worker",
    "promote_local_kv_cache_specs",
    "resolve_block_sizes",
    "scheduler_kv_cache_config",
    "tp_replicas",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]
