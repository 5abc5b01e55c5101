"""The KV cache manager core: block pool, prefix hashing, per-type managers, coordinator.

Pure Python, no I/O: no gRPC, Prometheus or torch. Layers, each with one job::

    PoolKVCache          engine-facing facade: validation, per-request tokens and progress
      KVCacheManager     vLLM's manager semantics: get_computed_blocks / allocate_slots / free
        coordinator      one manager per group; the hit every group agrees on
          managers       per attention type: table sizing, windows, hit search, caching
            BlockPool    ref counts, free queue (eviction order), prefix index, events
    hashing              chained block hashes, extra keys, the seed
    seed                 the seed file (the core's one file read) and its fingerprint
"""

from kvsvc.core.block_pool import NULL_BLOCK_ID, BlockPool
from kvsvc.core.coordinator import (
    HybridCoordinator,
    KVCacheCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
    make_coordinator,
)
from kvsvc.core.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventQueue,
)
from kvsvc.core.free_queue import FreeBlockQueue
from kvsvc.core.hashing import (
    DEFAULT_SHA256_CBOR_SEED,
    HASH_ALGOS,
    MAX_HASHING_STRING_BYTES,
    MAX_LORA_PATH_BYTES,
    MAX_MM_IDENTIFIER_BYTES,
    MAX_MM_ITEMS,
    BlockExtraKeys,
    BlockHash,
    BlockHasher,
    BlockHashListWithBlockSize,
    HashingContext,
    MultiModalItem,
    check_hashing_context,
    check_hashing_strings,
    hashes_at_block_size,
    validate_token_ids,
)
from kvsvc.core.mamba_manager import MambaManager
from kvsvc.core.manager import KVCacheBlocks, KVCacheManager, resolve_block_sizes
from kvsvc.core.managers import make_manager, manager_class_for
from kvsvc.core.pool import MAX_FREE_QUEUE_WALK, PoolKVCache
from kvsvc.core.pool_base import DEFAULT_RECENTLY_FREED
from kvsvc.core.pool_types import (
    AllocateOutcome,
    BlockTableView,
    PreparedLookup,
    RequestStart,
    RunningColumns,
)
from kvsvc.core.request import RequestState
from kvsvc.core.single_type_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SinkFullAttentionManager,
)
from kvsvc.core.stats import PrefixCacheStats, UsageSnapshot
from kvsvc.core.window_managers import ChunkedLocalAttentionManager, SlidingWindowManager

__all__ = [
    "DEFAULT_RECENTLY_FREED",
    "DEFAULT_SHA256_CBOR_SEED",
    "HASH_ALGOS",
    "MAX_FREE_QUEUE_WALK",
    "MAX_HASHING_STRING_BYTES",
    "MAX_LORA_PATH_BYTES",
    "MAX_MM_IDENTIFIER_BYTES",
    "MAX_MM_ITEMS",
    "MEDIUM_GPU",
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "AllocateOutcome",
    "BlockExtraKeys",
    "BlockHash",
    "BlockHashListWithBlockSize",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockTableView",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FreeBlockQueue",
    "FullAttentionManager",
    "HashingContext",
    "HybridCoordinator",
    "KVCacheBlocks",
    "KVCacheCoordinator",
    "KVCacheManager",
    "KVEvent",
    "KVEventBatch",
    "KVEventQueue",
    "MambaManager",
    "MultiModalItem",
    "NoPrefixCacheCoordinator",
    "PoolKVCache",
    "PrefixCacheStats",
    "PreparedLookup",
    "RequestStart",
    "RequestState",
    "RunningColumns",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "UnitaryCoordinator",
    "UsageSnapshot",
    "check_hashing_context",
    "check_hashing_strings",
    "hashes_at_block_size",
    "make_coordinator",
    "make_manager",
    "manager_class_for",
    "resolve_block_sizes",
    "validate_token_ids",
]
