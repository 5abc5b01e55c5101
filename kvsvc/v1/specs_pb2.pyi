from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVQuantMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_QUANT_MODE_UNSPECIFIED: _ClassVar[KVQuantMode]
    KV_QUANT_MODE_NONE: _ClassVar[KVQuantMode]
    KV_QUANT_MODE_FP8_PER_TENSOR: _ClassVar[KVQuantMode]
    KV_QUANT_MODE_INT8_PER_TOKEN_HEAD: _ClassVar[KVQuantMode]
    KV_QUANT_MODE_FP8_PER_TOKEN_HEAD: _ClassVar[KVQuantMode]
    KV_QUANT_MODE_INT4_PER_TOKEN_HEAD: _ClassVar[KVQuantMode]
    KV_QUANT_MODE_NVFP4: _ClassVar[KVQuantMode]
KV_QUANT_MODE_UNSPECIFIED: KVQuantMode
KV_QUANT_MODE_NONE: KVQuantMode
KV_QUANT_MODE_FP8_PER_TENSOR: KVQuantMode
KV_QUANT_MODE_INT8_PER_TOKEN_HEAD: KVQuantMode
KV_QUANT_MODE_FP8_PER_TOKEN_HEAD: KVQuantMode
KV_QUANT_MODE_INT4_PER_TOKEN_HEAD: KVQuantMode
KV_QUANT_MODE_NVFP4: KVQuantMode

class AttentionParams(_message.Message):
    __slots__ = ("num_kv_heads", "head_size", "dtype", "kv_quant_mode", "page_size_padded", "indexes_kv_by_block_stride")
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_QUANT_MODE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_PADDED_FIELD_NUMBER: _ClassVar[int]
    INDEXES_KV_BY_BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    num_kv_heads: int
    head_size: int
    dtype: str
    kv_quant_mode: KVQuantMode
    page_size_padded: int
    indexes_kv_by_block_stride: bool
    def __init__(self, num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_quant_mode: _Optional[_Union[KVQuantMode, str]] = ..., page_size_padded: _Optional[int] = ..., indexes_kv_by_block_stride: _Optional[bool] = ...) -> None: ...

class FullAttentionSpec(_message.Message):
    __slots__ = ("attention", "head_size_v", "sliding_window", "attention_chunk_size", "non_causal")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_V_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionParams
    head_size_v: int
    sliding_window: int
    attention_chunk_size: int
    non_causal: bool
    def __init__(self, attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., head_size_v: _Optional[int] = ..., sliding_window: _Optional[int] = ..., attention_chunk_size: _Optional[int] = ..., non_causal: _Optional[bool] = ...) -> None: ...

class MLAAttentionSpec(_message.Message):
    __slots__ = ("attention", "head_size_v", "cache_dtype_str", "alignment", "compress_ratio", "model_version", "non_causal")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_V_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_STR_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_RATIO_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NON_CAUSAL_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionParams
    head_size_v: int
    cache_dtype_str: str
    alignment: int
    compress_ratio: int
    model_version: str
    non_causal: bool
    def __init__(self, attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., head_size_v: _Optional[int] = ..., cache_dtype_str: _Optional[str] = ..., alignment: _Optional[int] = ..., compress_ratio: _Optional[int] = ..., model_version: _Optional[str] = ..., non_causal: _Optional[bool] = ...) -> None: ...

class SinkFullAttentionSpec(_message.Message):
    __slots__ = ("full", "sink_len")
    FULL_FIELD_NUMBER: _ClassVar[int]
    SINK_LEN_FIELD_NUMBER: _ClassVar[int]
    full: FullAttentionSpec
    sink_len: int
    def __init__(self, full: _Optional[_Union[FullAttentionSpec, _Mapping]] = ..., sink_len: _Optional[int] = ...) -> None: ...

class SlidingWindowSpec(_message.Message):
    __slots__ = ("attention", "sliding_window", "head_size_v")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_V_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionParams
    sliding_window: int
    head_size_v: int
    def __init__(self, attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., sliding_window: _Optional[int] = ..., head_size_v: _Optional[int] = ...) -> None: ...

class SlidingWindowMLASpec(_message.Message):
    __slots__ = ("attention", "sliding_window", "cache_dtype_str", "alignment", "compress_ratio", "model_version")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CACHE_DTYPE_STR_FIELD_NUMBER: _ClassVar[int]
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_RATIO_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionParams
    sliding_window: int
    cache_dtype_str: str
    alignment: int
    compress_ratio: int
    model_version: str
    def __init__(self, attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., sliding_window: _Optional[int] = ..., cache_dtype_str: _Optional[str] = ..., alignment: _Optional[int] = ..., compress_ratio: _Optional[int] = ..., model_version: _Optional[str] = ...) -> None: ...

class ChunkedLocalAttentionSpec(_message.Message):
    __slots__ = ("attention", "attention_chunk_size")
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    attention: AttentionParams
    attention_chunk_size: int
    def __init__(self, attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., attention_chunk_size: _Optional[int] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class MambaSpec(_message.Message):
    __slots__ = ("shapes", "dtypes", "page_size_padded", "mamba_type", "mamba_cache_mode", "num_speculative_blocks")
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_PADDED_FIELD_NUMBER: _ClassVar[int]
    MAMBA_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CACHE_MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    page_size_padded: int
    mamba_type: str
    mamba_cache_mode: str
    num_speculative_blocks: int
    def __init__(self, shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., dtypes: _Optional[_Iterable[str]] = ..., page_size_padded: _Optional[int] = ..., mamba_type: _Optional[str] = ..., mamba_cache_mode: _Optional[str] = ..., num_speculative_blocks: _Optional[int] = ...) -> None: ...

class UniformTypeSpecs(_message.Message):
    __slots__ = ("specs",)
    SPECS_FIELD_NUMBER: _ClassVar[int]
    specs: _containers.RepeatedCompositeFieldContainer[LayerSpec]
    def __init__(self, specs: _Optional[_Iterable[_Union[LayerSpec, _Mapping]]] = ...) -> None: ...

class KVCacheSpec(_message.Message):
    __slots__ = ("block_size", "full_attention", "mla_attention", "hidden_state", "sink_full_attention", "sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba", "encoder_only_attention", "cross_attention", "uniform_type")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MLA_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_FIELD_NUMBER: _ClassVar[int]
    SINK_FULL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_MLA_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_LOCAL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ONLY_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CROSS_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_TYPE_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    full_attention: FullAttentionSpec
    mla_attention: MLAAttentionSpec
    hidden_state: MLAAttentionSpec
    sink_full_attention: SinkFullAttentionSpec
    sliding_window: SlidingWindowSpec
    sliding_window_mla: SlidingWindowMLASpec
    chunked_local_attention: ChunkedLocalAttentionSpec
    mamba: MambaSpec
    encoder_only_attention: AttentionParams
    cross_attention: AttentionParams
    uniform_type: UniformTypeSpecs
    def __init__(self, block_size: _Optional[int] = ..., full_attention: _Optional[_Union[FullAttentionSpec, _Mapping]] = ..., mla_attention: _Optional[_Union[MLAAttentionSpec, _Mapping]] = ..., hidden_state: _Optional[_Union[MLAAttentionSpec, _Mapping]] = ..., sink_full_attention: _Optional[_Union[SinkFullAttentionSpec, _Mapping]] = ..., sliding_window: _Optional[_Union[SlidingWindowSpec, _Mapping]] = ..., sliding_window_mla: _Optional[_Union[SlidingWindowMLASpec, _Mapping]] = ..., chunked_local_attention: _Optional[_Union[ChunkedLocalAttentionSpec, _Mapping]] = ..., mamba: _Optional[_Union[MambaSpec, _Mapping]] = ..., encoder_only_attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., cross_attention: _Optional[_Union[AttentionParams, _Mapping]] = ..., uniform_type: _Optional[_Union[UniformTypeSpecs, _Mapping]] = ...) -> None: ...

class LayerSpec(_message.Message):
    __slots__ = ("name", "spec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: KVCacheSpec
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[KVCacheSpec, _Mapping]] = ...) -> None: ...

class KVCacheTensor(_message.Message):
    __slots__ = ("size", "shared_by", "offset", "block_stride")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARED_BY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    size: int
    shared_by: _containers.RepeatedScalarFieldContainer[str]
    offset: int
    block_stride: int
    def __init__(self, size: _Optional[int] = ..., shared_by: _Optional[_Iterable[str]] = ..., offset: _Optional[int] = ..., block_stride: _Optional[int] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("layer_names", "spec", "is_eagle_group")
    LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IS_EAGLE_GROUP_FIELD_NUMBER: _ClassVar[int]
    layer_names: _containers.RepeatedScalarFieldContainer[str]
    spec: KVCacheSpec
    is_eagle_group: bool
    def __init__(self, layer_names: _Optional[_Iterable[str]] = ..., spec: _Optional[_Union[KVCacheSpec, _Mapping]] = ..., is_eagle_group: _Optional[bool] = ...) -> None: ...

class KVCacheConfig(_message.Message):
    __slots__ = ("num_blocks", "tensors", "groups")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    tensors: _containers.RepeatedCompositeFieldContainer[KVCacheTensor]
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    def __init__(self, num_blocks: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[KVCacheTensor, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ...) -> None: ...
