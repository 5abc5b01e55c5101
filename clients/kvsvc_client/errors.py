"""Typed errors of the engine client, one per gRPC status the server uses."""

from __future__ import annotations

import grpc


class KVCacheError(Exception):
    """A call failed; ``code`` is the gRPC status, ``details`` the server's message (or
    gRPC's), ``hint`` what the client adds where gRPC says too little ("" if nothing)."""

    def __init__(self, code: grpc.StatusCode, details: str, hint: str = "") -> None:
        super().__init__(f"{code.name}: {details}" + (f"; {hint}" if hint else ""))
        self.code = code
        self.details = details
        self.hint = hint


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


# How gRPC reports a connection the server closed during the TLS handshake: a plaintext
# client at a TLS server, or a client without a certificate at one that requires it.
_HANDSHAKE_REFUSED = "Socket closed"


def connection_hint(details: str, *, tls: bool, client_cert: bool) -> str:
    """What a connection closed without a word most likely needs, "" when nothing is known.

    A server refuses a client's TLS handshake by closing the connection, and gRPC reports
    no more than ``UNAVAILABLE: ... Socket closed``: the client knows what it did not send.

    Args:
        details: gRPC's message.
        tls: the client spoke TLS.
        client_cert: it presented a certificate.
    """
    if _HANDSHAKE_REFUSED not in details:
        return ""
    if not tls:
        return (
            "if the server uses TLS, give the client the CA that signed its certificate "
            "(--tls-ca or KVSVC_TLS_CA; ClientOptions(tls_ca=...))"
        )
    if not client_cert:
        return (
            "if the server requires client certificates (mTLS), give the client one "
            "(--tls-cert and --tls-key, or KVSVC_TLS_CERT and KVSVC_TLS_KEY; "
            "ClientOptions(tls_cert=..., tls_key=...))"
        )
    return ""


def error_from_rpc(
    exc: grpc.RpcError, *, tls: bool | None = None, client_cert: bool = False
) -> KVCacheError:
    """The typed error of a failed call; ``tls`` (None: not known) and ``client_cert`` say
    how the client connected, for the hint an ``UNAVAILABLE`` gets (:func:`connection_hint`)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
    hint = ""
    if tls is not None and code == grpc.StatusCode.UNAVAILABLE:
        hint = connection_hint(details or "", tls=tls, client_cert=client_cert)
    return _BY_CODE.get(code, KVCacheError)(code, details or "", hint)
