from kvsvc.v1 import pools_pb2 as _pools_pb2
from kvsvc.v1 import specs_pb2 as _specs_pb2
from kvsvc.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "device", "hostname", "registered", "allocated", "heartbeat_age_seconds", "kv_cache_bytes", "memory_free_bytes", "allocated_bytes", "views", "connected", "live", "in_engine")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    IN_ENGINE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    device: str
    hostname: str
    registered: bool
    allocated: bool
    heartbeat_age_seconds: float
    kv_cache_bytes: int
    memory_free_bytes: int
    allocated_bytes: int
    views: _containers.RepeatedCompositeFieldContainer[_worker_pb2.AllocatedView]
    connected: bool
    live: bool
    in_engine: bool
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[str] = ..., hostname: _Optional[str] = ..., registered: _Optional[bool] = ..., allocated: _Optional[bool] = ..., heartbeat_age_seconds: _Optional[float] = ..., kv_cache_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., views: _Optional[_Iterable[_Union[_worker_pb2.AllocatedView, _Mapping]]] = ..., connected: _Optional[bool] = ..., live: _Optional[bool] = ..., in_engine: _Optional[bool] = ...) -> None: ...

class PoolSummary(_message.Message):
    __slots__ = ("name", "state", "world_size", "num_registered", "block_size", "num_blocks", "hash_algo", "enable_prefix_caching", "error", "workers", "max_model_len", "epoch", "persistent", "prefix_cache_retention_interval")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RETENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: _pools_pb2.PoolState
    world_size: int
    num_registered: int
    block_size: int
    num_blocks: int
    hash_algo: str
    enable_prefix_caching: bool
    error: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    max_model_len: int
    epoch: str
    persistent: bool
    prefix_cache_retention_interval: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[_pools_pb2.PoolState, str]] = ..., world_size: _Optional[int] = ..., num_registered: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hash_algo: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., error: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., max_model_len: _Optional[int] = ..., epoch: _Optional[str] = ..., persistent: _Optional[bool] = ..., prefix_cache_retention_interval: _Optional[int] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolSummary]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolSummary, _Mapping]]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("pool", "plan_json", "worker_configs")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    WORKER_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    pool: PoolSummary
    plan_json: str
    worker_configs: _containers.RepeatedCompositeFieldContainer[_specs_pb2.KVCacheConfig]
    def __init__(self, pool: _Optional[_Union[PoolSummary, _Mapping]] = ..., plan_json: _Optional[str] = ..., worker_configs: _Optional[_Iterable[_Union[_specs_pb2.KVCacheConfig, _Mapping]]] = ...) -> None: ...

class ForceResetPrefixCacheRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class ForceResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_requests_flagged", "num_cached_blocks_dropped")
    NUM_REQUESTS_FLAGGED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_requests_flagged: int
    num_cached_blocks_dropped: int
    def __init__(self, num_requests_flagged: _Optional[int] = ..., num_cached_blocks_dropped: _Optional[int] = ...) -> None: ...

class SnapshotPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class SnapshotPoolChunk(_message.Message):
    __slots__ = ("data", "total_bytes")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ...) -> None: ...
