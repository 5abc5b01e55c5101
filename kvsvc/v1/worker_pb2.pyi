from kvsvc.v1 import pools_pb2 as _pools_pb2
from kvsvc.v1 import specs_pb2 as _specs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryProfile(_message.Message):
    __slots__ = ("total_bytes", "free_bytes", "non_kv_bytes", "kv_cache_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NON_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    free_bytes: int
    non_kv_bytes: int
    kv_cache_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., non_kv_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("pool", "rank", "world_size", "device", "hostname", "layers", "memory", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "max_num_encoder_input_tokens", "model", "total_num_kv_heads", "allocation_id", "in_engine")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_ENCODER_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    IN_ENGINE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    rank: int
    world_size: int
    device: str
    hostname: str
    layers: _containers.RepeatedCompositeFieldContainer[_specs_pb2.LayerSpec]
    memory: MemoryProfile
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_model_len: int
    max_num_encoder_input_tokens: int
    model: str
    total_num_kv_heads: int
    allocation_id: str
    in_engine: bool
    def __init__(self, pool: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., hostname: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[_specs_pb2.LayerSpec, _Mapping]]] = ..., memory: _Optional[_Union[MemoryProfile, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_encoder_input_tokens: _Optional[int] = ..., model: _Optional[str] = ..., total_num_kv_heads: _Optional[int] = ..., allocation_id: _Optional[str] = ..., in_engine: _Optional[bool] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "state", "num_registered")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: _pools_pb2.PoolState
    num_registered: int
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[_pools_pb2.PoolState, str]] = ..., num_registered: _Optional[int] = ...) -> None: ...

class WatchPlanRequest(_message.Message):
    __slots__ = ("pool", "rank", "session_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    rank: int
    session_id: str
    def __init__(self, pool: _Optional[str] = ..., rank: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class WatchPlanResponse(_message.Message):
    __slots__ = ("state", "config", "error", "max_model_len")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    state: _pools_pb2.PoolState
    config: _specs_pb2.KVCacheConfig
    error: str
    max_model_len: int
    def __init__(self, state: _Optional[_Union[_pools_pb2.PoolState, str]] = ..., config: _Optional[_Union[_specs_pb2.KVCacheConfig, _Mapping]] = ..., error: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class AllocatedView(_message.Message):
    __slots__ = ("layer_name", "shape", "stride", "dtype")
    LAYER_NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layer_name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, layer_name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReportAllocationRequest(_message.Message):
    __slots__ = ("pool", "rank", "session_id", "num_blocks", "allocated_bytes", "memory_free_bytes", "views", "allocation_id")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    pool: str
    rank: int
    session_id: str
    num_blocks: int
    allocated_bytes: int
    memory_free_bytes: int
    views: _containers.RepeatedCompositeFieldContainer[AllocatedView]
    allocation_id: str
    def __init__(self, pool: _Optional[str] = ..., rank: _Optional[int] = ..., session_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., views: _Optional[_Iterable[_Union[AllocatedView, _Mapping]]] = ..., allocation_id: _Optional[str] = ...) -> None: ...

class ReportAllocationResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: _pools_pb2.PoolState
    def __init__(self, state: _Optional[_Union[_pools_pb2.PoolState, str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("pool", "rank", "session_id", "memory_free_bytes")
    POOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    rank: int
    session_id: str
    memory_free_bytes: int
    def __init__(self, pool: _Optional[str] = ..., rank: _Optional[int] = ..., session_id: _Optional[str] = ..., memory_free_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("state", "reregister")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    state: _pools_pb2.PoolState
    reregister: bool
    def __init__(self, state: _Optional[_Union[_pools_pb2.PoolState, str]] = ..., reregister: _Optional[bool] = ...) -> None: ...
