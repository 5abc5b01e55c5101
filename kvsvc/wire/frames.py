"""What both ends of the framed transport agree on (see ``protos/kvsvc/v1/frames.proto``).

A frame is an 8-byte prefix (the header's and the body's lengths, little-endian uint32),
a :class:`~kvsvc.v1.frames_pb2.FrameHeader` and the body: a request or response message
as gRPC would carry it. A connection opens with :data:`MAGIC` and a hello frame.
"""

from __future__ import annotations

import struct

from kvsvc.v1.frames_pb2 import FrameHeader, FrameMetadata

# The first bytes a client sends: a listener of another protocol (or a gRPC client on
# this one, whose HTTP/2 preface starts "PRI * HT") is recognised at once.
MAGIC = b"kvsvcF1\n"
VERSION = 1
PREFIX = struct.Struct("<II")
# The largest header either end accepts; a body is bounded by the server's
# max_message_bytes (requests) and the client's message limit (replies).
MAX_HEADER_BYTES = 65_536
# How a client target names the framed transport: "frames:unix:PATH", "frames:HOST:PORT".
TARGET_PREFIX = "frames:"
# gRPC status codes by number (what FrameHeader.code carries).
OK = 0


def is_frames_target(target: str) -> bool:
    """Whether a client target names the framed transport rather than gRPC."""
    return target.startswith(TARGET_PREFIX)


def frames_address(target: str) -> str:
    """The address of a ``frames:`` target: ``unix:PATH`` or ``HOST:PORT``."""
    return target[len(TARGET_PREFIX) :]


def frame(header: bytes, body: bytes = b"") -> bytes:
    """One frame's bytes."""
    return PREFIX.pack(len(header), len(body)) + header + body


def hello_header(metadata: tuple[tuple[str, str], ...] | None) -> bytes:
    """The header of a client's hello: the version and the connection's call metadata."""
    return FrameHeader(
        version=VERSION,
        metadata=[FrameMetadata(key=k, value=v) for k, v in metadata or ()],
    ).SerializeToString()


def call_header(method: str) -> bytes:
    """The header of a call of ``method`` (its gRPC path)."""
    return FrameHeader(method=method).SerializeToString()


def reply_header(
    code: int,
    details: str = "",
    metadata: tuple[tuple[str, str], ...] = (),
    *,
    close: bool = False,
    version: int = 0,
) -> bytes:
    """The header of a reply (``code`` 0: success, the body follows)."""
    return FrameHeader(
        version=version,
        code=code,
        details=details,
        metadata=[FrameMetadata(key=k, value=v) for k, v in metadata],
        close=close,
    ).SerializeToString()


__all__ = [
    "MAGIC",
    "MAX_HEADER_BYTES",
    "OK",
    "PREFIX",
    "TARGET_PREFIX",
    "VERSION",
    "FrameHeader",
    "call_header",
    "frame",
    "frames_address",
    "hello_header",
    "is_frames_target",
    "reply_header",
]
