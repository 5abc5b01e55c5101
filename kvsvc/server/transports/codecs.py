"""The request parsers of the hot methods, where not the message's ``FromString``.

Both listeners (gRPC's generic handlers, the framed listener's methods) take a method's
request parser from here, so a method is read the same way on every transport: the
handler gets what the parser returns and answers a ``DecodeError`` INVALID_ARGUMENT as
for any other method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvsvc.server.step_codec import parse_step_request
from kvsvc.v1 import kvcache_pb2

KVCACHE_SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"].full_name
# Method path -> parser: Step's columns are read from the bytes without a protobuf object
# (kvsvc.server.step_codec, equivalent to protobuf's parser on every message).
REQUEST_PARSERS: dict[str, Callable[[bytes], Any]] = {
    f"/{KVCACHE_SERVICE}/Step": parse_step_request,
}


def request_parser(path: str, default: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """The parser of method ``path`` ("/service/Method"): its own, else ``default``."""
    return REQUEST_PARSERS.get(path, default)
