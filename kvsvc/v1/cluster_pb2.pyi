from kvsvc.v1 import kvcache_pb2 as _kvcache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("token_ids", "packed_token_ids", "hashing", "engines")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    hashing: _kvcache_pb2.HashingContext
    engines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., hashing: _Optional[_Union[_kvcache_pb2.HashingContext, _Mapping]] = ..., engines: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineScore(_message.Message):
    __slots__ = ("engine", "num_cached_tokens")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    num_cached_tokens: int
    def __init__(self, engine: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "seed_mismatch", "upper_bound")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SEED_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    UPPER_BOUND_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[EngineScore]
    seed_mismatch: _containers.RepeatedScalarFieldContainer[str]
    upper_bound: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, scores: _Optional[_Iterable[_Union[EngineScore, _Mapping]]] = ..., seed_mismatch: _Optional[_Iterable[str]] = ..., upper_bound: _Optional[_Iterable[str]] = ...) -> None: ...
