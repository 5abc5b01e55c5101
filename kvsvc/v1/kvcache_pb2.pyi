from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllocateStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOCATE_STATUS_UNSPECIFIED: _ClassVar[AllocateStatus]
    ALLOCATE_STATUS_OK: _ClassVar[AllocateStatus]
    ALLOCATE_STATUS_NO_SPACE: _ClassVar[AllocateStatus]
    ALLOCATE_STATUS_RECOMPUTE: _ClassVar[AllocateStatus]

class FreeReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FREE_REASON_UNSPECIFIED: _ClassVar[FreeReason]
    FREE_REASON_FINISHED: _ClassVar[FreeReason]
    FREE_REASON_PREEMPTED: _ClassVar[FreeReason]

class StepOperationType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_OPERATION_TYPE_UNSPECIFIED: _ClassVar[StepOperationType]
    STEP_OPERATION_TYPE_ALLOCATE: _ClassVar[StepOperationType]
    STEP_OPERATION_TYPE_FREE: _ClassVar[StepOperationType]
    STEP_OPERATION_TYPE_PREEMPT: _ClassVar[StepOperationType]
    STEP_OPERATION_TYPE_LOOKUP: _ClassVar[StepOperationType]
    STEP_OPERATION_TYPE_CACHE: _ClassVar[StepOperationType]
ALLOCATE_STATUS_UNSPECIFIED: AllocateStatus
ALLOCATE_STATUS_OK: AllocateStatus
ALLOCATE_STATUS_NO_SPACE: AllocateStatus
ALLOCATE_STATUS_RECOMPUTE: AllocateStatus
FREE_REASON_UNSPECIFIED: FreeReason
FREE_REASON_FINISHED: FreeReason
FREE_REASON_PREEMPTED: FreeReason
STEP_OPERATION_TYPE_UNSPECIFIED: StepOperationType
STEP_OPERATION_TYPE_ALLOCATE: StepOperationType
STEP_OPERATION_TYPE_FREE: StepOperationType
STEP_OPERATION_TYPE_PREEMPT: StepOperationType
STEP_OPERATION_TYPE_LOOKUP: StepOperationType
STEP_OPERATION_TYPE_CACHE: StepOperationType

class MultiModalItem(_message.Message):
    __slots__ = ("identifier", "offset", "length")
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    identifier: str
    offset: int
    length: int
    def __init__(self, identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class HashingContext(_message.Message):
    __slots__ = ("cache_salt", "lora_name", "lora_path", "mm_items", "prompt_embeds_digests", "lora_id")
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    MM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    cache_salt: str
    lora_name: str
    lora_path: str
    mm_items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    prompt_embeds_digests: _containers.RepeatedScalarFieldContainer[bytes]
    lora_id: int
    def __init__(self, cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., mm_items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., prompt_embeds_digests: _Optional[_Iterable[bytes]] = ..., lora_id: _Optional[int] = ...) -> None: ...

class RequestStart(_message.Message):
    __slots__ = ("hashing", "skip_prefix_cache_read", "resumed", "num_encoder_tokens", "num_prompt_tokens", "max_cache_hit_tokens", "num_draft_tokens")
    HASHING_FIELD_NUMBER: _ClassVar[int]
    SKIP_PREFIX_CACHE_READ_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    hashing: HashingContext
    skip_prefix_cache_read: bool
    resumed: bool
    num_encoder_tokens: int
    num_prompt_tokens: int
    max_cache_hit_tokens: int
    num_draft_tokens: int
    def __init__(self, hashing: _Optional[_Union[HashingContext, _Mapping]] = ..., skip_prefix_cache_read: _Optional[bool] = ..., resumed: _Optional[bool] = ..., num_encoder_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., max_cache_hit_tokens: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("pool", "request_id", "new_token_ids", "packed_new_token_ids", "num_new_tokens", "num_lookahead_tokens", "start", "num_rejected_tokens", "call_id", "num_in_flight_tokens")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_new_token_ids: bytes
    num_new_tokens: int
    num_lookahead_tokens: int
    start: RequestStart
    num_rejected_tokens: int
    call_id: str
    num_in_flight_tokens: int
    def __init__(self, pool: _Optional[str] = ..., request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., packed_new_token_ids: _Optional[bytes] = ..., num_new_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ..., start: _Optional[_Union[RequestStart, _Mapping]] = ..., num_rejected_tokens: _Optional[int] = ..., call_id: _Optional[str] = ..., num_in_flight_tokens: _Optional[int] = ...) -> None: ...

class GroupBlocks(_message.Message):
    __slots__ = ("block_ids", "num_null_blocks")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_null_blocks: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_null_blocks: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("status", "new_blocks", "num_cached_tokens", "num_scheduled_tokens", "num_computed_tokens")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    status: AllocateStatus
    new_blocks: _containers.RepeatedCompositeFieldContainer[GroupBlocks]
    num_cached_tokens: int
    num_scheduled_tokens: int
    num_computed_tokens: int
    def __init__(self, status: _Optional[_Union[AllocateStatus, str]] = ..., new_blocks: _Optional[_Iterable[_Union[GroupBlocks, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("pool", "request_ids", "reason", "call_id", "needing_recompute")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NEEDING_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: FreeReason
    call_id: str
    needing_recompute: bool
    def __init__(self, pool: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[_Union[FreeReason, str]] = ..., call_id: _Optional[str] = ..., needing_recompute: _Optional[bool] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_freed_blocks", "num_freed_requests")
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_freed_blocks: int
    num_freed_requests: int
    def __init__(self, num_freed_blocks: _Optional[int] = ..., num_freed_requests: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool", "types", "request_ids", "num_token_ids", "token_ids", "num_new_tokens", "num_lookahead_tokens", "starts", "num_rejected_tokens", "packed_token_ids", "free_queue_head_limit", "call_id", "free_queue_head_offset", "num_in_flight_tokens")
    class StartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RequestStart
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RequestStart, _Mapping]] = ...) -> None: ...
    POOL_FIELD_NUMBER: _ClassVar[int]
    TYPES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FREE_QUEUE_HEAD_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FREE_QUEUE_HEAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    types: _containers.RepeatedScalarFieldContainer[StepOperationType]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_lookahead_tokens: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.MessageMap[int, RequestStart]
    num_rejected_tokens: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    free_queue_head_limit: int
    call_id: str
    free_queue_head_offset: int
    num_in_flight_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[str] = ..., types: _Optional[_Iterable[_Union[StepOperationType, str]]] = ..., request_ids: _Optional[_Iterable[str]] = ..., num_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., num_lookahead_tokens: _Optional[_Iterable[int]] = ..., starts: _Optional[_Mapping[int, RequestStart]] = ..., num_rejected_tokens: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., free_queue_head_limit: _Optional[int] = ..., call_id: _Optional[str] = ..., free_queue_head_offset: _Optional[int] = ..., num_in_flight_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("statuses", "num_scheduled_tokens", "num_computed_tokens", "num_cached_tokens", "num_groups", "num_new_blocks", "new_block_ids", "num_null_blocks", "num_freed_blocks", "errors", "free_queue_head", "num_free_blocks")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: StepError
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NULL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    FREE_QUEUE_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[AllocateStatus]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_groups: int
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_null_blocks: _containers.RepeatedScalarFieldContainer[int]
    num_freed_blocks: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.MessageMap[int, StepError]
    free_queue_head: _containers.RepeatedScalarFieldContainer[int]
    num_free_blocks: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[AllocateStatus, str]]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., num_groups: _Optional[int] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_null_blocks: _Optional[_Iterable[int]] = ..., num_freed_blocks: _Optional[_Iterable[int]] = ..., errors: _Optional[_Mapping[int, StepError]] = ..., free_queue_head: _Optional[_Iterable[int]] = ..., num_free_blocks: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("pool", "token_ids", "hashing", "packed_token_ids")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hashing: HashingContext
    packed_token_ids: bytes
    def __init__(self, pool: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., hashing: _Optional[_Union[HashingContext, _Mapping]] = ..., packed_token_ids: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("pool", "request_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    request_id: str
    def __init__(self, pool: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("groups", "num_computed_tokens", "num_tokens", "needs_recompute")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[BlockTable]
    num_computed_tokens: int
    num_tokens: int
    needs_recompute: bool
    def __init__(self, groups: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., num_computed_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ..., needs_recompute: _Optional[bool] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("pool", "from_sequence", "epoch", "send_caught_up")
    POOL_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEND_CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    pool: str
    from_sequence: int
    epoch: str
    send_caught_up: bool
    def __init__(self, pool: _Optional[str] = ..., from_sequence: _Optional[int] = ..., epoch: _Optional[str] = ..., send_caught_up: _Optional[bool] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "medium", "group_index", "group_kind", "lora_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_KIND_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    lora_name: str
    medium: str
    group_index: int
    group_kind: str
    lora_id: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., medium: _Optional[str] = ..., group_index: _Optional[int] = ..., group_kind: _Optional[str] = ..., lora_id: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "group_index")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    group_index: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ..., group_index: _Optional[int] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("sequence", "timestamp", "events", "gap", "oldest_available_sequence", "epoch", "caught_up")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AVAILABLE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CAUGHT_UP_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    gap: bool
    oldest_available_sequence: int
    epoch: str
    caught_up: bool
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., gap: _Optional[bool] = ..., oldest_available_sequence: _Optional[int] = ..., epoch: _Optional[str] = ..., caught_up: _Optional[bool] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("queries", "hits", "preempted_queries", "preempted_hits", "requests", "preempted_requests")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_HITS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    queries: int
    hits: int
    preempted_queries: int
    preempted_hits: int
    requests: int
    preempted_requests: int
    def __init__(self, queries: _Optional[int] = ..., hits: _Optional[int] = ..., preempted_queries: _Optional[int] = ..., preempted_hits: _Optional[int] = ..., requests: _Optional[int] = ..., preempted_requests: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("pool", "num_blocks", "num_free_blocks", "usage", "num_requests", "num_cached_blocks", "prefix_cache", "num_evictions", "num_allocated_blocks", "block_size", "kv_cache_capacity_tokens", "num_requests_needing_recompute", "num_invalidations")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ALLOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_NEEDING_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_INVALIDATIONS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    num_cached_blocks: int
    prefix_cache: PrefixCacheStats
    num_evictions: int
    num_allocated_blocks: int
    block_size: int
    kv_cache_capacity_tokens: int
    num_requests_needing_recompute: int
    num_invalidations: int
    def __init__(self, pool: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., usage: _Optional[float] = ..., num_requests: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., num_evictions: _Optional[int] = ..., num_allocated_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_cache_capacity_tokens: _Optional[int] = ..., num_requests_needing_recompute: _Optional[int] = ..., num_invalidations: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: _Optional[bool] = ...) -> None: ...

class SnapshotIndexRequest(_message.Message):
    __slots__ = ("pool", "max_hashes_per_message")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MAX_HASHES_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    max_hashes_per_message: int
    def __init__(self, pool: _Optional[str] = ..., max_hashes_per_message: _Optional[int] = ...) -> None: ...

class IndexGroup(_message.Message):
    __slots__ = ("group_index", "group_kind", "block_size", "sliding_window")
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    group_index: int
    group_kind: str
    block_size: int
    sliding_window: int
    def __init__(self, group_index: _Optional[int] = ..., group_kind: _Optional[str] = ..., block_size: _Optional[int] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class SnapshotIndexResponse(_message.Message):
    __slots__ = ("epoch", "sequence", "groups", "hash_block_size", "hash_algo", "medium", "hash_seed_fingerprint", "total_hashes", "group_index", "block_hashes", "block_counts", "last")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HASHES_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    sequence: int
    groups: _containers.RepeatedCompositeFieldContainer[IndexGroup]
    hash_block_size: int
    hash_algo: str
    medium: str
    hash_seed_fingerprint: str
    total_hashes: int
    group_index: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_counts: _containers.RepeatedScalarFieldContainer[int]
    last: bool
    def __init__(self, epoch: _Optional[str] = ..., sequence: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[IndexGroup, _Mapping]]] = ..., hash_block_size: _Optional[int] = ..., hash_algo: _Optional[str] = ..., medium: _Optional[str] = ..., hash_seed_fingerprint: _Optional[str] = ..., total_hashes: _Optional[int] = ..., group_index: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_counts: _Optional[_Iterable[int]] = ..., last: _Optional[bool] = ...) -> None: ...
