"""Who may call what: bearer credentials per role, checked once per call by an interceptor.

Three roles (DESIGN, "Who may do what"):

- ``engine``: the KVCache API's calls on its own requests (Allocate, Step, Free, Lookup,
  GetBlockTable), GetUsage, ResetPrefixCache and ListPools (to wait for its pool);
- ``agent``: the Worker API (Register, WatchPlan, ReportAllocation, Heartbeat);
- ``admin``: the Admin API (ListPools, GetPlan, ...), and the KVCache API's views of the
  whole pool and its reset (GetUsage, WatchEvents, SnapshotIndex, ResetPrefixCache).

WatchEvents and SnapshotIndex are the operator's (and an indexer's, which runs with the
admin token): a stored block's event carries the token ids and LoRA name of the request
that filled it, whichever engine sent it, and the index lists every engine's cached
hashes. An engine that could follow them would read the prompts of every other engine of
the pool, cache salt or not; so an engine token is refused (PERMISSION_DENIED, saying
why), and engines cannot learn each other's prompts, adapters or salts through a stream.

A credential of one role is refused by the others' services (PERMISSION_DENIED); no or an
unknown credential is UNAUTHENTICATED. Health and reflection stay open for probes.

The check runs in a server interceptor, before the request message is read, so every
method of every kvsvc service is covered in one place (a new method cannot be left open by
forgetting a decorator) and a large unauthenticated message is neither parsed nor held:
the refusal goes out before it arrives.

Engine identity: an engine token may carry a name (``NAME TOKEN`` in a token file). A
named engine's request ids live in its own namespace (see :func:`scoped_request_id`), so
one engine cannot read, extend or free another's requests. Unnamed engine tokens and the
all-roles token share the default namespace.
"""

from __future__ import annotations

import enum
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvsvc.server.config import ConfigError, ServerConfig
from kvsvc.server.errors import CallObserver
from kvsvc.server.namespace import current_engine
from kvsvc.server.seclog import RateLimitedLog

# Engine names: what may precede a request id in the server's tables.
MAX_ENGINE_NAME = 64


class Role(enum.Enum):
    ENGINE = "engine"
    AGENT = "agent"
    ADMIN = "admin"


ALL_ROLES = frozenset(Role)


@dataclass(frozen=True, slots=True)
class Credential:
    """What a bearer token entitles its holder to."""

    roles: frozenset[Role]
    engine: str = ""  # the engine's namespace ("" = the shared default one)
    source: str = ""  # where it was configured (for the log; never the secret)


_KVCACHE = "kvsvc.v1.KVCacheService"
_WORKER = "kvsvc.v1.WorkerService"
_ADMIN = "kvsvc.v1.AdminService"
_SERVICE_ROLES: dict[str, frozenset[Role]] = {
    _KVCACHE: frozenset({Role.ENGINE}),
    _WORKER: frozenset({Role.AGENT}),
    _ADMIN: frozenset({Role.ADMIN}),
}
_ENGINE_OR_ADMIN = frozenset({Role.ENGINE, Role.ADMIN})
_METHOD_ROLES: dict[str, frozenset[Role]] = {
    # vLLM's engine resets its own cache (LLM.reset_prefix_cache); an operator may too.
    f"/{_KVCACHE}/ResetPrefixCache": _ENGINE_OR_ADMIN,
    # Read-only views both need: an engine waits for its pool to be READY and learns its
    # shape; an operator (kvsvc ctl) reads usage.
    f"/{_ADMIN}/ListPools": _ENGINE_OR_ADMIN,
    f"/{_KVCACHE}/GetUsage": _ENGINE_OR_ADMIN,
    # Every engine's requests, as the pool sees them: operators and indexers (which run
    # with the admin token: `kvsvc indexer`, `kvsvc ctl events`) only.
    f"/{_KVCACHE}/WatchEvents": frozenset({Role.ADMIN}),
    f"/{_KVCACHE}/SnapshotIndex": frozenset({Role.ADMIN}),
}
# Why a method is not an engine's, added to its PERMISSION_DENIED message.
_WHOLE_POOL = (
    " (it carries every engine's token ids and LoRA names; follow the events with the "
    "operator's token, as kvsvc indexer and kvsvc ctl events do)"
)
_REFUSAL_NOTES: dict[str, str] = {
    f"/{_KVCACHE}/WatchEvents": _WHOLE_POOL,
    f"/{_KVCACHE}/SnapshotIndex": _WHOLE_POOL,
}


def roles_for_method(method: str) -> frozenset[Role] | None:
    """The roles that may call ``/package.Service/Method``; None for open services."""
    explicit = _METHOD_ROLES.get(method)
    if explicit is not None:
        return explicit
    service = method[1:].partition("/")[0]
    return _SERVICE_ROLES.get(service)


def check_engine_name(name: str, where: str) -> None:
    if not name or len(name) > MAX_ENGINE_NAME or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(
            f"{where}: engine name {name!r}: use 1-{MAX_ENGINE_NAME} letters, digits, '-', "
            "'_' or '.'"
        )


def read_token_file(path: str, role: str) -> list[tuple[str, str]]:
    """``(engine name or "", token)`` per line of a token file.

    A line is ``TOKEN`` or (engine tokens) ``ENGINE_NAME TOKEN``; blank lines and lines
    starting with ``#`` are skipped. A file without any token is an error: a server that
    silently ran open because a secret volume was empty would be worse than one that stops.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{role} token file {path}: {exc.strerror}") from None
    entries: list[tuple[str, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{role} token file {path}, line {number}"
        if len(parts) == 1:
            entries.append(("", parts[0]))
        elif len(parts) == 2 and role == "engine":
            check_engine_name(parts[0], where)
            entries.append((parts[0], parts[1]))
        else:
            expected = "'TOKEN' or 'ENGINE_NAME TOKEN'" if role == "engine" else "'TOKEN'"
            raise ConfigError(f"{where}: expected {expected}")
    if not entries:
        raise ConfigError(f"{role} token file {path} holds no token")
    return entries


class Credentials:
    """Every configured token, by its ``authorization`` metadata value."""

    def __init__(self) -> None:
        self._by_header: dict[bytes, Credential] = {}

    def add(self, token: str, credential: Credential) -> None:
        if len(token) < 16:
            raise ConfigError(
                f"{credential.source}: a token must be at least 16 characters (got "
                f"{len(token)}); generate one with `openssl rand -hex 32`"
            )
        header = f"Bearer {token}".encode()
        existing = self._by_header.get(header)
        if existing is not None and existing != credential:
            raise ConfigError(
                f"{credential.source}: the same token is also configured as {existing.source}; "
                "give each role (and each engine) its own token"
            )
        self._by_header[header] = credential

    @property
    def enabled(self) -> bool:
        return bool(self._by_header)

    def lookup(self, header: str | bytes) -> Credential | None:
        """The credential whose token this header carries (constant time per candidate)."""
        given = header.encode() if isinstance(header, str) else header
        found: Credential | None = None
        # Compare against every token, so the time taken says nothing about which matched.
        for expected, credential in self._by_header.items():
            if hmac.compare_digest(given, expected):
                found = credential
        return found


def load_credentials(config: ServerConfig) -> Credentials:
    """The server's credentials from its config (token files, inline tokens).

    Raises:
        ConfigError: an unreadable or empty token file, a too-short token, a token reused
            across roles.
    """
    credentials = Credentials()
    if config.auth_token:
        credentials.add(config.auth_token, Credential(ALL_ROLES, source="auth_token"))
    if config.auth_token_file:
        for _, token in read_token_file(config.auth_token_file, "auth"):
            credentials.add(token, Credential(ALL_ROLES, source="auth_token_file"))
    for role in Role:
        inline = getattr(config, f"{role.value}_token")
        if inline:
            credentials.add(inline, Credential(frozenset({role}), source=f"{role.value}_token"))
        path = getattr(config, f"{role.value}_token_file")
        if path:
            for engine, token in read_token_file(path, role.value):
                credentials.add(
                    token,
                    Credential(
                        frozenset({role}),
                        engine=engine,
                        source=f"{role.value}_token_file"
                        + (f" (engine {engine})" if engine else ""),
                    ),
                )
    return credentials


def env_tokens(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Server config overrides from ``KVSVC_AUTH_TOKEN``/``KVSVC_{ENGINE,AGENT,ADMIN}_TOKEN``
    and their ``*_FILE`` forms."""
    overrides: dict[str, str] = {}
    for key in ("auth", "engine", "agent", "admin"):
        value = environ.get(f"KVSVC_{key.upper()}_TOKEN")
        if value:
            overrides[f"{key}_token"] = value
        path = environ.get(f"KVSVC_{key.upper()}_TOKEN_FILE")
        if path:
            overrides[f"{key}_token_file"] = path
    return overrides


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.1:1234`` -> ``10.0.0.1`` (the port changes with every connection)."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0] or rest
    return peer


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a call is refused: its status code and the message the caller gets."""

    code: grpc.StatusCode
    reason: str


def authorize(
    credentials: Credentials, header: str | bytes | None, method: str, allowed: frozenset[Role]
) -> Credential | Refusal:
    """The credential of a call of ``method`` (which ``allowed`` roles may make) carrying
    the ``authorization`` value ``header`` (None: none), or why it is refused."""
    credential = credentials.lookup(header) if header is not None else None
    return decide(credential, header is not None, method, allowed)


def decide(
    credential: Credential | None, header_given: bool, method: str, allowed: frozenset[Role]
) -> Credential | Refusal:
    """:func:`authorize` for a credential already looked up (the framed transport looks
    its connection's up once). Both transports (gRPC's interceptor, the framed listener)
    decide by this one rule."""
    if credential is None:
        # Where kvsvc's own clients read a token of a role this method takes.
        env = " or ".join(sorted(f"KVSVC_{r.value.upper()}_TOKEN" for r in allowed))
        reason = (
            f"missing authorization metadata (expected 'Bearer <token>'; kvsvc clients "
            f"read it from --token-file or {env})"
            if not header_given
            else f"unknown token in the authorization metadata (check --token-file / {env})"
        )
        return Refusal(grpc.StatusCode.UNAUTHENTICATED, reason)
    if not credential.roles & allowed:
        names = "/".join(sorted(r.value for r in allowed))
        held = "/".join(sorted(r.value for r in credential.roles))
        reason = f"{method.rpartition('/')[2]} needs the {names} role; this token is {held}"
        reason += _REFUSAL_NOTES.get(method, "")
        return Refusal(grpc.StatusCode.PERMISSION_DENIED, reason)
    return credential


def report_refusal(
    log: RateLimitedLog, observer: CallObserver, method: str, refusal: Refusal, peer: str
) -> None:
    """Log a refused call on the security log (rate-limited per code and peer host: a
    flood of new connections from one host is one line per interval) and count it."""
    short = method.rpartition("/")[2]
    host = peer_host(peer or "?")
    log.warning(
        f"{refusal.code.name}:{host}", "auth refused: %s from %s: %s", short, host, refusal.reason
    )
    observer.observe(short, refusal.code, 0.0)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to kvsvc services without a credential of a role that may make them."""

    def __init__(self, credentials: Credentials, observer: CallObserver) -> None:
        self._credentials = credentials
        self._observer = observer
        self._log = RateLimitedLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        allowed = roles_for_method(method)
        if allowed is None:
            return await continuation(handler_call_details)
        header: str | bytes | None = None
        for key, value in handler_call_details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == "authorization":
                header = value
                break
        handler = await continuation(handler_call_details)
        if handler is None:
            # No such method (``/kvsvc.v1.KVCacheService/Nope``): gRPC answers
            # UNIMPLEMENTED, whoever asks; there is nothing to refuse or to wrap.
            return None
        decision = authorize(self._credentials, header, method, allowed)
        if isinstance(decision, Refusal):
            return self._deny(handler, method, decision)
        if decision.engine and Role.ENGINE in allowed:
            return _with_engine(handler, decision.engine)
        return handler

    def _deny(
        self, handler: grpc.RpcMethodHandler, method: str, refusal: Refusal
    ) -> grpc.RpcMethodHandler:
        log = self._log
        observer = self._observer

        async def deny(requests: Any, context: grpc.aio.ServicerContext) -> None:
            report_refusal(log, observer, method, refusal, context.peer())
            await context.abort(refusal.code, refusal.reason)

        def skip(_: bytes) -> None:
            return None

        # Registered as request-streaming, whatever the method is: gRPC then hands the
        # handler the requests as a stream it never reads, so the refusal is answered
        # before the message arrives. A unary handler would receive the whole message
        # first (up to max_message_bytes per call, held in memory while it arrives):
        # four unauthenticated 60 MiB calls held ~540 MiB that way, ~8 MiB this way (what
        # HTTP/2 flow control lets a peer send unasked).
        if handler.response_streaming:  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(deny, request_deserializer=skip)
        return grpc.stream_unary_rpc_method_handler(deny, request_deserializer=skip)


def _with_engine(handler: grpc.RpcMethodHandler, engine: str) -> grpc.RpcMethodHandler:
    """``handler`` run with :data:`current_engine` set to ``engine``."""
    request_deserializer = handler.request_deserializer  # type: ignore[attr-defined]
    response_serializer = handler.response_serializer  # type: ignore[attr-defined]
    if handler.response_streaming:  # type: ignore[attr-defined]
        inner_stream = handler.unary_stream  # type: ignore[attr-defined]

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            current_engine.set(engine)
            async for message in inner_stream(request, context):
                yield message

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer, response_serializer
        )
    inner = handler.unary_unary  # type: ignore[attr-defined]

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        current_engine.set(engine)
        return await inner(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer, response_serializer)
