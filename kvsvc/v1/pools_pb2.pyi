from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class PoolState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_STATE_UNSPECIFIED: _ClassVar[PoolState]
    POOL_STATE_WAITING_FOR_WORKERS: _ClassVar[PoolState]
    POOL_STATE_PLANNED: _ClassVar[PoolState]
    POOL_STATE_READY: _ClassVar[PoolState]
    POOL_STATE_DEGRADED: _ClassVar[PoolState]
POOL_STATE_UNSPECIFIED: PoolState
POOL_STATE_WAITING_FOR_WORKERS: PoolState
POOL_STATE_PLANNED: PoolState
POOL_STATE_READY: PoolState
POOL_STATE_DEGRADED: PoolState
