from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrameHeader(_message.Message):
    __slots__ = ("version", "method", "metadata", "code", "details", "close")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    version: int
    method: str
    metadata: _containers.RepeatedCompositeFieldContainer[FrameMetadata]
    code: int
    details: str
    close: bool
    def __init__(self, version: _Optional[int] = ..., method: _Optional[str] = ..., metadata: _Optional[_Iterable[_Union[FrameMetadata, _Mapping]]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., close: _Optional[bool] = ...) -> None: ...

class FrameMetadata(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
