from kvsvc.v1 import kvcache_pb2 as _kvcache_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RouteTerm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_TERM_UNSPECIFIED: _ClassVar[RouteTerm]
    ROUTE_TERM_PREFIX: _ClassVar[RouteTerm]
    ROUTE_TERM_LOAD: _ClassVar[RouteTerm]
    ROUTE_TERM_TIE: _ClassVar[RouteTerm]
    ROUTE_TERM_ONLY_CANDIDATE: _ClassVar[RouteTerm]
ROUTE_TERM_UNSPECIFIED: RouteTerm
ROUTE_TERM_PREFIX: RouteTerm
ROUTE_TERM_LOAD: RouteTerm
ROUTE_TERM_TIE: RouteTerm
ROUTE_TERM_ONLY_CANDIDATE: RouteTerm

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

class RouteRequest(_message.Message):
    __slots__ = ("token_ids", "packed_token_ids", "hashing", "block_hashes", "block_size", "num_prompt_tokens", "engines", "policy")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HASHING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    hashing: _kvcache_pb2.HashingContext
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_size: int
    num_prompt_tokens: int
    engines: _containers.RepeatedScalarFieldContainer[str]
    policy: RoutePolicy
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., hashing: _Optional[_Union[_kvcache_pb2.HashingContext, _Mapping]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_size: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., engines: _Optional[_Iterable[str]] = ..., policy: _Optional[_Union[RoutePolicy, _Mapping]] = ...) -> None: ...

class RoutePolicy(_message.Message):
    __slots__ = ("prefix_weight", "load_weight", "load_floor")
    PREFIX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FLOOR_FIELD_NUMBER: _ClassVar[int]
    prefix_weight: float
    load_weight: float
    load_floor: float
    def __init__(self, prefix_weight: _Optional[float] = ..., load_weight: _Optional[float] = ..., load_floor: _Optional[float] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("reported", "num_running_requests", "num_used_blocks", "num_blocks", "age_seconds", "num_routed_since_report", "relative_load")
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_SINCE_REPORT_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_LOAD_FIELD_NUMBER: _ClassVar[int]
    reported: bool
    num_running_requests: int
    num_used_blocks: int
    num_blocks: int
    age_seconds: float
    num_routed_since_report: int
    relative_load: float
    def __init__(self, reported: _Optional[bool] = ..., num_running_requests: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., age_seconds: _Optional[float] = ..., num_routed_since_report: _Optional[int] = ..., relative_load: _Optional[float] = ...) -> None: ...

class RouteCandidate(_message.Message):
    __slots__ = ("engine", "num_cached_tokens", "load", "score")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    engine: str
    num_cached_tokens: int
    load: EngineLoad
    score: float
    def __init__(self, engine: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("chosen", "runner_up", "decided_by", "num_prompt_tokens", "num_candidates", "seed_mismatch", "upper_bound", "policy")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UP_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SEED_MISMATCH_FIELD_NUMBER: _ClassVar[int]
    UPPER_BOUND_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    chosen: RouteCandidate
    runner_up: RouteCandidate
    decided_by: RouteTerm
    num_prompt_tokens: int
    num_candidates: int
    seed_mismatch: _containers.RepeatedScalarFieldContainer[str]
    upper_bound: _containers.RepeatedScalarFieldContainer[str]
    policy: RoutePolicy
    def __init__(self, chosen: _Optional[_Union[RouteCandidate, _Mapping]] = ..., runner_up: _Optional[_Union[RouteCandidate, _Mapping]] = ..., decided_by: _Optional[_Union[RouteTerm, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_candidates: _Optional[int] = ..., seed_mismatch: _Optional[_Iterable[str]] = ..., upper_bound: _Optional[_Iterable[str]] = ..., policy: _Optional[_Union[RoutePolicy, _Mapping]] = ...) -> None: ...
