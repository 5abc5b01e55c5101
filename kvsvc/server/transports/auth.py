"""Who may call what, on either transport: bearer credentials per role, and the refusals.

Four roles (DESIGN, "Who may do what"):

- ``engine``: the KVCache API's calls on its own requests (Allocate, Step, Free, Lookup,
  GetBlockTable), GetUsage, ResetPrefixCache and ListPools (to wait for its pool);
- ``agent``: the Worker API (Register, WatchPlan, ReportAllocation, Heartbeat);
- ``admin``: the Admin API (ListPools, GetPlan, ...), and the KVCache API's views of the
  whole pool and its reset (GetUsage, WatchEvents, SnapshotIndex, ResetPrefixCache);
- ``indexer``: exactly what ``kvsvc indexer`` calls: WatchEvents and SnapshotIndex, and
  GetUsage (the pool's counts, which it publishes as the engine's load for Route). Not
  SnapshotPool (a pool's whole state, its hash seed included: SnapshotIndex carries only
  the seed's fingerprint, and the cluster's routers get the seed from their operator),
  not the resets: an indexer's token that leaks cannot invalidate a pool.

WatchEvents and SnapshotIndex are the operator's and the indexers': a stored block's
event carries the token ids and LoRA name of the request that filled it, whichever
engine sent it, and the index lists every engine's cached hashes. An engine that could
follow them would read the prompts of every other engine of the pool, cache salt or not;
so an engine token is refused (PERMISSION_DENIED, saying why), and engines cannot learn
each other's prompts, adapters or salts through a stream.

A credential of one role is refused by the others' services (PERMISSION_DENIED); no or an
unknown credential is UNAUTHENTICATED. Health and reflection stay open for probes.

Both listeners decide by this module, so a method cannot be open on one transport and
closed on the other: the gRPC listener's interceptor checks every call
(:class:`~kvsvc.server.transports.grpc_listener.AuthInterceptor`); the framed listener
looks a connection's credential up once, in its hello, and checks each call's role
(:mod:`kvsvc.server.transports.frames_listener`). What they refuse is logged here too
(:func:`report_refusal`, :func:`report_malformed`): one rate-limited line per peer host on
the security log (:mod:`kvsvc.server.seclog`), never the token.

Engine identity: an engine token may carry a name (``NAME TOKEN`` in a token file). A
named engine's request ids live in its own namespace (see
:func:`kvsvc.server.namespace.scoped_request_id`), so one engine cannot read, extend or
free another's requests. Unnamed engine tokens and the all-roles token share the default
namespace.
"""

from __future__ import annotations

import enum
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import grpc

from kvsvc.server.config import ConfigError, ServerConfig
from kvsvc.server.errors import CallObserver
from kvsvc.server.seclog import RateLimitedLog

# Engine names: what may precede a request id in the server's tables.
MAX_ENGINE_NAME = 64


class Role(enum.Enum):
    ENGINE = "engine"
    AGENT = "agent"
    ADMIN = "admin"
    INDEXER = "indexer"


ALL_ROLES = frozenset(Role)


@dataclass(frozen=True, slots=True)
class Credential:
    """What a bearer token entitles its holder to."""

    roles: frozenset[Role]
    engine: str = ""  # the engine's namespace ("" = the shared default one)
    source: str = ""  # where it was configured (for the log; never the secret)
    # The pools an engine token may use (``pools=a,b`` in its line); None: every pool.
    pools: frozenset[str] | None = None


_KVCACHE = "kvsvc.v1.KVCacheService"
_WORKER = "kvsvc.v1.WorkerService"
_ADMIN = "kvsvc.v1.AdminService"
_SERVICE_ROLES: dict[str, frozenset[Role]] = {
    _KVCACHE: frozenset({Role.ENGINE}),
    _WORKER: frozenset({Role.AGENT}),
    _ADMIN: frozenset({Role.ADMIN}),
}
_ENGINE_OR_ADMIN = frozenset({Role.ENGINE, Role.ADMIN})
_ADMIN_OR_INDEXER = frozenset({Role.ADMIN, Role.INDEXER})
_METHOD_ROLES: dict[str, frozenset[Role]] = {
    # vLLM's engine resets its own cache (LLM.reset_prefix_cache); an operator may too.
    f"/{_KVCACHE}/ResetPrefixCache": _ENGINE_OR_ADMIN,
    # Read-only views both need: an engine waits for its pool to be READY and learns its
    # shape; an operator (kvsvc ctl) reads usage.
    f"/{_ADMIN}/ListPools": _ENGINE_OR_ADMIN,
    # Usage is counts only (no token ids, no salts): the indexer reads it for the load
    # Route weighs (kvsvc.cluster.indexer).
    f"/{_KVCACHE}/GetUsage": frozenset({Role.ENGINE, Role.ADMIN, Role.INDEXER}),
    # Every engine's requests, as the pool sees them: operators (`kvsvc ctl events`) and
    # indexers (`kvsvc indexer`) only.
    f"/{_KVCACHE}/WatchEvents": _ADMIN_OR_INDEXER,
    f"/{_KVCACHE}/SnapshotIndex": _ADMIN_OR_INDEXER,
}
# Why a method is not an engine's, added to its PERMISSION_DENIED message.
_WHOLE_POOL = (
    " (it carries every engine's token ids and LoRA names; follow the events with an "
    "indexer's token, as kvsvc indexer does, or the operator's, as kvsvc ctl events does)"
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


class TokenLine(NamedTuple):
    """One token of a token file, with what its line says about it."""

    engine: str  # "" for an unnamed token
    token: str
    pools: frozenset[str] | None  # ``pools=a,b``; None: every pool
    where: str  # "engine token file PATH, line N" (for errors; never the secret)


# The option of an engine token line that scopes it to pools.
POOLS_OPTION = "pools="


def read_token_file(path: str, role: str) -> list[TokenLine]:
    """The tokens of a token file, one per line.

    A line is ``TOKEN``; an engine line may name its engine and its pools:
    ``[ENGINE_NAME] TOKEN [pools=POOL,POOL...]``. A named engine's request ids live in
    its own namespace; an engine token with ``pools=`` may only use those pools (without
    it, every pool: what such lines always meant). Blank lines and lines starting with
    ``#`` are skipped. A file without any token is an error: a server that silently ran
    open because a secret volume was empty would be worse than one that stops.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{role} token file {path}: {exc.strerror}") from None
    entries: list[TokenLine] = []
    expected = (
        "'TOKEN' or 'ENGINE_NAME TOKEN', each optionally followed by 'pools=POOL,...'"
        if role == "engine"
        else "'TOKEN'"
    )
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"{role} token file {path}, line {number}"
        pools: frozenset[str] | None = None
        if role == "engine" and parts[-1].startswith(POOLS_OPTION):
            pools = parse_pool_list(parts.pop()[len(POOLS_OPTION) :], where)
        if any(part.startswith(POOLS_OPTION) for part in parts):
            raise ConfigError(f"{where}: expected {expected} (a token may not start with 'pools=')")
        if len(parts) == 1:
            entries.append(TokenLine("", parts[0], pools, where))
        elif len(parts) == 2 and role == "engine":
            check_engine_name(parts[0], where)
            entries.append(TokenLine(parts[0], parts[1], pools, where))
        else:
            raise ConfigError(f"{where}: expected {expected}")
    if not entries:
        raise ConfigError(f"{role} token file {path} holds no token")
    return entries


def parse_pool_list(text: str, where: str) -> frozenset[str]:
    """``a,b`` -> {"a", "b"}: the pools of a scoped engine token (at least one)."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ConfigError(f"{where}: pools= needs pool names separated by commas, got {text!r}")
    return frozenset(names)


def check_pools_known(pools: frozenset[str] | None, known: Iterable[str], where: str) -> None:
    """A token scoped to a pool the server does not serve is a typo: refuse it at start
    (it would be refused on every call)."""
    unknown = sorted(set(pools or ()) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: pools= names {', '.join(map(repr, unknown))}, which the server does "
            f"not serve (pools: {', '.join(sorted(known))})"
        )


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
    known = [pool.name for pool in config.pools]
    if config.auth_token:
        credentials.add(config.auth_token, Credential(ALL_ROLES, source="auth_token"))
    if config.auth_token_file:
        for line in read_token_file(config.auth_token_file, "auth"):
            credentials.add(line.token, Credential(ALL_ROLES, source="auth_token_file"))
    for role in Role:
        inline = getattr(config, f"{role.value}_token")
        if inline:
            scope = config.engine_token_pools if role is Role.ENGINE else None
            pools = frozenset(scope) if scope is not None else None
            credentials.add(
                inline,
                Credential(frozenset({role}), source=f"{role.value}_token", pools=pools),
            )
        path = getattr(config, f"{role.value}_token_file")
        if path:
            for line in read_token_file(path, role.value):
                check_pools_known(line.pools, known, line.where)
                credentials.add(
                    line.token,
                    Credential(
                        frozenset({role}),
                        engine=line.engine,
                        source=f"{role.value}_token_file"
                        + (f" (engine {line.engine})" if line.engine else ""),
                        pools=line.pools,
                    ),
                )
    return credentials


def env_tokens(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Server config overrides from ``KVSVC_AUTH_TOKEN``,
    ``KVSVC_{ENGINE,AGENT,ADMIN,INDEXER}_TOKEN`` and their ``*_FILE`` forms."""
    overrides: dict[str, str] = {}
    for key in ("auth", *(role.value for role in Role)):
        value = environ.get(f"KVSVC_{key.upper()}_TOKEN")
        if value:
            overrides[f"{key}_token"] = value
        path = environ.get(f"KVSVC_{key.upper()}_TOKEN_FILE")
        if path:
            overrides[f"{key}_token_file"] = path
    # The pools of KVSVC_ENGINE_TOKEN ("a,b"), as pools= scopes a token file's line.
    scope = environ.get("KVSVC_ENGINE_TOKEN_POOLS")
    if scope:
        overrides["engine_token_pools"] = scope
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


_malformed_log = RateLimitedLog()


def report_malformed(method: str, peer: str) -> None:
    """A request body that does not parse: one line per method and peer host per interval
    on the security log (the gRPC listener answers it INVALID_ARGUMENT)."""
    host = peer_host(peer or "?")
    _malformed_log.warning(
        f"malformed:{method}:{host}", "malformed request: %s from %s", method, host
    )
