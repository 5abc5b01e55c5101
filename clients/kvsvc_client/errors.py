"""Typed errors of the engine client, one per gRPC status the server uses."""

from __future__ import annotations

import grpc


class KVCacheError(Exception):
    """A call failed; ``code`` is the gRPC status, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgumentError(KVCacheError):
    """The request was malformed; the message names the field. Nothing changed."""


class NotFoundError(KVCacheError):
    """Unknown pool or request."""


class NotReadyError(KVCacheError):
    """The pool is not READY yet (FAILED_PRECONDITION)."""


class AlreadyExistsError(KVCacheError):
    pass


class UnauthenticatedError(KVCacheError):
    """Missing or wrong token."""


class PermissionDeniedError(KVCacheError):
    """The credential is valid but its role (or engine) may not make this call."""


class ResourceExhaustedError(KVCacheError):
    """A server bound was hit (live requests, subscribers, ...); nothing changed."""


class UnavailableError(KVCacheError):
    """The server could not be reached (or went away) within the deadline."""


_BY_CODE: dict[grpc.StatusCode, type[KVCacheError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: NotReadyError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
}


def error_from_rpc(exc: grpc.RpcError) -> KVCacheError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
    return _BY_CODE.get(code, KVCacheError)(code, details or "")
