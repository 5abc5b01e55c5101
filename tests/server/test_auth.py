"""Roles, credentials and engine namespaces against a real server.

Every method of every kvsvc service is called on every listener of the server (gRPC and
the framed transport, each on a TCP port and a Unix socket) without a credential, with an
unknown one, with each role's and with the all-roles one. The table is built from the
service descriptors, so a method added later is covered without editing this file; a
refused call must answer its exact code and leave the pool as it was.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvsvc_client import (
    BlockStored,
    ClientOptions,
    EventBatch,
    HashingContext,
    InvalidArgumentError,
    KVCacheClient,
    NotFoundError,
    OperationError,
    PermissionDeniedError,
    RequestStart,
    UnauthenticatedError,
    resolve_token,
)

from kvsvc.errors import quoted
from kvsvc.server.config import ConfigError, PoolConfig, ServerConfig
from kvsvc.server.namespace import scoped_request_id, unscope_message
from kvsvc.server.transports.auth import Credential, Role, load_credentials, read_token_file
from kvsvc.v1 import admin_pb2, cluster_pb2, kvcache_pb2, kvcache_pb2_grpc, pools_pb2, worker_pb2
from tests.frames.helpers import RawClient, short_dir
from tests.server.harness import ServerThread, bring_up, running_server

ENGINE_A = "engine-a-token-0123456789"
ENGINE_B = "engine-b-token-0123456789"
ENGINE_ANON = "engine-unnamed-0123456789"
# Engine tokens scoped to pools (pools= in their line): one to the other pool q only (every
# call naming p must be refused), one to both.
ENGINE_Q = "engine-q-only-token-0123456789"
ENGINE_PQ = "engine-p-and-q-token-0123456789"
AGENT = "agent-token-0123456789abc"
ADMIN = "admin-token-0123456789abc"
INDEXER = "indexer-token-0123456789ab"
ALL_ROLES = "all-roles-token-0123456789"
UNKNOWN = "not-a-token-0123456789"

# Which role each method belongs to; the other roles must be refused.
SERVICES = {
    kvcache_pb2.DESCRIPTOR.services_by_name["KVCacheService"]: Role.ENGINE,
    worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]: Role.AGENT,
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"]: Role.ADMIN,
}
# Services of kvsvc.v1 the kvsvc server does not serve (the router serves Score).
NOT_SERVED = {"kvsvc.v1.ClusterIndexService"}
# The services whose unary methods the framed transport serves (the rest answer
# UNIMPLEMENTED there, whatever the credential: they are gRPC's).
FRAMED_SERVICES = {"kvsvc.v1.KVCacheService", "kvsvc.v1.AdminService"}
# Methods a second role may also call (read-only views an engine or operator needs).
SHARED = {
    "ResetPrefixCache": {Role.ENGINE, Role.ADMIN},
    "ListPools": {Role.ENGINE, Role.ADMIN},
    "GetUsage": {Role.ENGINE, Role.ADMIN, Role.INDEXER},  # the indexer: the load for Route
    "WatchEvents": {Role.ADMIN, Role.INDEXER},
    "SnapshotIndex": {Role.ADMIN, Role.INDEXER},
}
TOKEN_OF = {Role.ENGINE: ENGINE_A, Role.AGENT: AGENT, Role.ADMIN: ADMIN, Role.INDEXER: INDEXER}
METHODS = [
    (service, method, role) for service, role in SERVICES.items() for method in service.methods
]
# The server's listeners, by transport and kind of address: every method is called on
# each (test_the_table_covers_every_listener_of_the_server keeps it complete).
LISTENERS = ("grpc-tcp", "grpc-unix", "frames-tcp", "frames-unix")


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    tmp = tmp_path_factory.mktemp("tokens")
    config = {
        "engine_token_file": _write(
            tmp / "engine",
            f"# engines\nengine-a {ENGINE_A}\nengine-b {ENGINE_B}\n{ENGINE_ANON}\n"
            f"engine-q {ENGINE_Q} pools=q\n{ENGINE_PQ} pools=p,q\n",
        ),
        "agent_token_file": _write(tmp / "agent", f"{AGENT}\n"),
        "admin_token_file": _write(tmp / "admin", f"{ADMIN}\n"),
        "indexer_token_file": _write(tmp / "indexer", f"{INDEXER}\n"),
        "auth_token": ALL_ROLES,
    }
    with (
        short_dir() as sockets,
        running_server(
            PoolConfig(name="p", max_model_len=256),
            PoolConfig(name="q", max_model_len=256),
            listen=f"127.0.0.1:0,unix:{sockets}/g.sock",
            frames_listen=f"unix:{sockets}/f.sock,127.0.0.1:0",
            **config,
        ) as srv,
    ):
        ranks = bring_up(srv, "p", kv_cache_bytes=64 * 32 * 1024, token=AGENT)
        ranks += bring_up(srv, "q", kv_cache_bytes=64 * 32 * 1024, token=AGENT)
        yield srv
        for rank in ranks:
            rank.close()


def test_every_service_of_the_contract_is_in_the_table() -> None:
    """A service added to kvsvc.v1 must be classified here (its role, framed or not)."""
    contract = {
        service.full_name
        for module in (admin_pb2, cluster_pb2, kvcache_pb2, pools_pb2, worker_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
    }
    assert contract == {s.full_name for s in SERVICES} | NOT_SERVED


def _listeners(server: ServerThread) -> dict[str, list[str]]:
    """The server's listening addresses by LISTENERS name."""
    srv = server.server
    frames = srv.frames_addresses
    return {
        "grpc-tcp": [f"127.0.0.1:{srv.port}"],
        "grpc-unix": list(srv.unix_sockets),
        "frames-tcp": [a for a in frames if not a.startswith("unix:")],
        "frames-unix": [a for a in frames if a.startswith("unix:")],
    }


def test_the_table_covers_every_listener_of_the_server(server: ServerThread) -> None:
    assert {name: len(found) for name, found in _listeners(server).items()} == dict.fromkeys(
        LISTENERS, 1
    )


def _listener(server: ServerThread, name: str) -> str:
    """The address of the server's listener ``name`` (one of LISTENERS)."""
    (address,) = _listeners(server)[name]
    return address


def _request(method: Any, pool: str) -> Any:
    """An otherwise empty request of ``method`` naming ``pool`` (where it names one)."""
    request = method.input_type._concrete_class()
    if pool and "pool" in method.input_type.fields_by_name:
        request.pool = pool
    return request


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token is not None else None


def _status(number: int) -> grpc.StatusCode:
    return next(code for code in grpc.StatusCode if code.value[0] == number)


def _call(
    address: str, service: Any, method: Any, token: str | None, request: Any = None
) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` over gRPC; its status code (OK for a stream's first message) and
    details."""
    full = f"/{service.full_name}/{method.name}"
    request = _request(method, "") if request is None else request
    response_class = method.output_type._concrete_class
    metadata = _metadata(token)
    with grpc.insecure_channel(address) as channel:
        try:
            if method.server_streaming:
                stream = channel.unary_stream(
                    full, type(request).SerializeToString, response_class.FromString
                )(request, metadata=metadata, timeout=5)
                try:
                    next(stream, None)
                finally:
                    stream.cancel()
            else:
                channel.unary_unary(
                    full, type(request).SerializeToString, response_class.FromString
                )(request, metadata=metadata, timeout=5)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def _framed_call(
    address: str, service: Any, method: Any, token: str | None, request: Any
) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` on a new framed connection whose hello carries ``token``; a refused
    hello (no known token: the connection could make no call) is the call's answer."""
    with RawClient(address) as raw:
        hello = raw.hello(_metadata(token))
        if hello.code:
            assert hello.close
            return _status(hello.code), hello.details
        reply, _ = raw.call(f"/{service.full_name}/{method.name}", request.SerializeToString())
    return _status(reply.code), reply.details


def _pool_fingerprint(server: ServerThread) -> tuple[Any, ...]:
    """Everything of pool p a call could change: its core state whole, lifecycle, events,
    ranks and call log (read on the server's loop)."""

    def read() -> tuple[Any, ...]:
        pool = server.server.pools.by_name["p"]
        return (
            pool.state,
            pool.cache.to_state(),
            pool.events.last_sequence,
            pool.num_invalidations,
            pool.num_registrations,
            pool.num_allocation_reports,
            sorted((rank, slot.session_id) for rank, slot in pool.slots.items()),
            pool.calls.to_state(),
        )

    return server.run(read)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def held_state(server: ServerThread) -> Iterator[None]:
    """The pool holds something a refused call could wrongly change: a live request of
    engine-a and a cached prefix (a free one), so a reset, a free or an admission shows."""
    with KVCacheClient(server.address, pool="p", options=ClientOptions(token=ENGINE_A)) as a:
        assert a.allocate("held", list(range(7000, 7040)), 40, start=RequestStart()).ok
        assert a.allocate("cached", list(range(8000, 8040)), 40, start=RequestStart()).ok
        assert a.free("cached") > 0
        yield
        a.free("held")


@pytest.mark.parametrize("listener", LISTENERS)
@pytest.mark.parametrize(
    ("service", "method", "role"),
    METHODS,
    ids=[f"{s.name}.{m.name}" for s, m, _ in METHODS],
)
def test_every_method_checks_the_credential_and_its_role_on_every_transport(
    server: ServerThread, held_state: None, service: Any, method: Any, role: Role, listener: str
) -> None:
    """No credential: UNAUTHENTICATED; an unknown one: UNAUTHENTICATED; another role's:
    PERMISSION_DENIED; each with the pool unchanged. The method's own roles (and the
    all-roles token) are served: the same answer on every transport. Over frames, a
    streaming method or one of a service frames do not carry answers UNIMPLEMENTED to
    caller with a known token (a hello without one is refused before any method is
    named)."""
    address = _listener(server, listener)
    framed = listener.startswith("frames")
    call = _framed_call if framed else _call
    allowed = SHARED.get(method.name, {role})
    if framed:  # an indexer's token is refused at the framed hello, whatever it calls
        allowed = allowed - {Role.INDEXER}
    # What a refused call sends names the live pool: were it let through, it would act.
    real = _request(method, "p")
    if framed and (method.server_streaming or service.full_name not in FRAMED_SERVICES):
        for token in (None, UNKNOWN):
            code, details = call(address, service, method, token, real)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (token, code, details)
        # An agent's or an indexer's token may make no framed call: refused at the hello
        # (it takes no connection slot).
        for token in (AGENT, INDEXER):
            code, details = call(address, service, method, token, real)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (token, code, details)
        for token in (ENGINE_A, ADMIN, ALL_ROLES):
            code, details = call(address, service, method, token, real)
            assert code == grpc.StatusCode.UNIMPLEMENTED, (token, code, details)
            assert "not served over frames" in details
        return
    refusals: list[tuple[str | None, grpc.StatusCode]] = [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (UNKNOWN, grpc.StatusCode.UNAUTHENTICATED),
    ]
    refusals += [
        (TOKEN_OF[other], grpc.StatusCode.PERMISSION_DENIED)
        for other in Role
        if other not in allowed
    ]
    names_a_pool = "pool" in method.input_type.fields_by_name
    if Role.ENGINE in allowed and names_a_pool:
        # An engine token scoped to pool q may not touch pool p, by any method.
        refusals.append((ENGINE_Q, grpc.StatusCode.PERMISSION_DENIED))
    for token, expected in refusals:
        before = _pool_fingerprint(server)
        code, details = call(address, service, method, token, real)
        assert code == expected, (token, code, details)
        assert _pool_fingerprint(server) == before, f"a refused {method.name} changed the pool"
        if token is not None:
            assert token not in details  # the secret is not echoed back
        if token == ENGINE_Q and Role.ENGINE in allowed:
            assert 'may not use pool "p"' in details, details
    # Served: an empty request gets the same answer over every transport, never a refusal.
    empty = _request(method, "")
    scoped = (ENGINE_PQ,) if Role.ENGINE in allowed else ()
    for token in (*(TOKEN_OF[r] for r in allowed), ALL_ROLES, *scoped):
        code, details = call(address, service, method, token, empty)
        assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), (
            token,
            code,
            details,
        )
        if framed:
            assert (code, details) == _call(server.address, service, method, token, empty)


def test_health_and_reflection_stay_open(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_refused_calls_are_logged_rate_limited_without_the_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvsvc.security")
    bad = "leaked-secret-0123456789"
    service = SERVICES_BY_NAME["KVCacheService"]
    # Its own server: the rate limit is per server and per peer.
    with running_server(PoolConfig(name="p", max_model_len=64), auth_token=ALL_ROLES) as srv:
        for _ in range(5):
            _call(srv.address, service, service.methods_by_name["GetUsage"], bad)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvsvc.security"]
    assert lines, "an auth failure must be logged"
    assert len(lines) < 5, "repeated failures from one peer are rate-limited"
    assert "GetUsage" in lines[0] and "127.0.0.1" in lines[0]
    assert all(bad not in line for line in lines)


SERVICES_BY_NAME = {s.name: s for s in SERVICES}


def _engine(server: ServerThread, token: str) -> KVCacheClient:
    return KVCacheClient(server.address, pool="p", options=ClientOptions(token=token))


def test_engines_have_their_own_request_namespaces(server: ServerThread) -> None:
    prompt = list(range(1000, 1040))
    with _engine(server, ENGINE_A) as a, _engine(server, ENGINE_B) as b:
        first = a.allocate("r1", prompt, 40, start=RequestStart())
        assert first.ok
        # Engine B cannot see, extend or free engine A's r1 ...
        with pytest.raises(NotFoundError, match='request "r1" is not live') as info:
            b.block_table("r1")
        assert "\\u0000" not in info.value.details and "engine-a" not in info.value.details
        with pytest.raises(NotFoundError):
            b.allocate("r1", [7], 1)
        with pytest.raises(NotFoundError):
            b.free("r1")
        step = b.step()
        step.free("r1")
        (outcome,) = step.send()
        assert isinstance(outcome, OperationError) and '"r1"' in outcome.message
        assert outcome.code == grpc.StatusCode.NOT_FOUND and "\\u0000" not in outcome.message
        # ... and may use the same id for its own request: separate blocks.
        second = b.allocate("r1", prompt, 40, start=RequestStart())
        assert second.ok
        assert a.block_table("r1").num_tokens == 40
        assert b.block_table("r1").num_tokens == 40
        # Same prompt, same pool, no salt: B's request reuses A's cached blocks (a pool is
        # one cache); a cache salt is what keeps tenants apart.
        assert second.num_cached_tokens == 32
        assert a.free("r1") > 0
        assert b.block_table("r1").num_tokens == 40
        assert b.free("r1") > 0
    with _engine(server, ENGINE_ANON) as anon, _engine(server, ALL_ROLES) as shared:
        # Unnamed engine tokens and the all-roles token share the default namespace.
        assert anon.allocate("d1", prompt, 40, start=RequestStart()).ok
        assert shared.block_table("d1").num_tokens == 40
        assert shared.free("d1") > 0


@pytest.mark.parametrize("listener", LISTENERS)
def test_an_engine_token_scoped_to_its_pools_cannot_touch_another_pool(
    server: ServerThread, held_state: None, listener: str
) -> None:
    """The attack of issue 32: an engine token meant for one pool allocated another down
    to a few free blocks, read its free queue and reset its prefix cache. Scoped with
    pools=q, every call of it on pool p is PERMISSION_DENIED naming the pool and changes
    nothing there; on q it is served, and ListPools shows it q alone."""
    address = _listener(server, listener)
    target = f"frames:{address}" if listener.startswith("frames") else address
    options = ClientOptions(token=ENGINE_Q, retries=0, timeout=5)
    before = _pool_fingerprint(server)
    with KVCacheClient(target, pool="p", options=options) as foreign:
        attempts = {
            "Allocate": lambda: foreign.allocate("x", list(range(64)), 64, start=RequestStart()),
            "Step": lambda: foreign.step().allocate("x", list(range(64)), 64, start=True).send(),
            "free queue": lambda: _free_queue_read(foreign),
            "Lookup": lambda: foreign.lookup(list(range(7000, 7040))),
            "ResetPrefixCache": foreign.reset_prefix_cache,
            "GetUsage": foreign.usage,
            "GetBlockTable": lambda: foreign.block_table("held"),
            "Free": lambda: foreign.free("held"),
        }
        for what, attempt in attempts.items():
            with pytest.raises(PermissionDeniedError) as refused:
                attempt()
            assert 'may not use pool "p"' in refused.value.details, (what, refused.value)
            assert '"q"' in refused.value.details and ENGINE_Q not in refused.value.details
        assert [pool.name for pool in foreign.list_pools()] == ["q"]
    assert _pool_fingerprint(server) == before, "a refused call changed pool p"
    with KVCacheClient(target, pool="q", options=options) as own:
        rid = f"own-{listener}"
        assert own.allocate(rid, list(range(100, 132)), 32, start=RequestStart()).ok
        assert own.usage().num_requests == 1
        assert own.free(rid) > 0


def _free_queue_read(client: KVCacheClient) -> Any:
    """A Step that only reads the head of the pool's free queue (the eviction order)."""
    step = client.step()
    step.free_queue_head_limit = 16
    return step.send()


def _live_ids(server: ServerThread, request_id: str) -> set[str]:
    """The server-side ids of the live requests an engine calls ``request_id``."""

    def read() -> set[str]:
        ids = server.server.pools.by_name["p"].cache.request_ids()
        return {rid for rid in ids if rid.rpartition("\x00")[2] == request_id}

    return server.run(read)  # type: ignore[no-any-return]


def _refused_in_step(outcome: Any, request_id: str) -> None:
    """``outcome`` is a Step operation refused as NOT_FOUND, naming the id as sent."""
    assert isinstance(outcome, OperationError), outcome
    assert outcome.code == grpc.StatusCode.NOT_FOUND, outcome
    assert quoted(request_id) in outcome.message
    assert "engine-a" not in outcome.message and "\\u0000" not in outcome.message


@pytest.mark.parametrize("listener", LISTENERS)
def test_named_engines_are_isolated_in_steps(server: ServerThread, listener: str) -> None:
    """Engines admit, extend, preempt and free through Step (as the vLLM adapter does):
    engine B cannot see, extend, free or preempt engine A's request, and the same id used
    by both names two independent requests."""
    address = _listener(server, listener)
    target = f"frames:{address}" if listener.startswith("frames") else address
    prompt = list(range(3000, 3040))
    # An id per listener: a freed id is remembered a while (a repeated Free of it is OK).
    rid = f"s-{listener}"

    def engine(token: str) -> KVCacheClient:
        options = ClientOptions(token=token, retries=0, timeout=5)
        return KVCacheClient(target, pool="p", options=options)

    with engine(ENGINE_A) as a, engine(ENGINE_B) as b:
        (admitted,) = a.step().allocate(rid, prompt, 40, start=RequestStart()).send()
        assert admitted.ok and admitted.num_computed_tokens == 40
        a_blocks = a.block_table(rid).groups
        try:
            refused = b.step().allocate(rid, [7], 1).free(rid).preempt(rid).send()
            for outcome in refused:
                _refused_in_step(outcome, rid)
            with pytest.raises(NotFoundError):
                b.block_table(rid)
            assert a.block_table(rid).groups == a_blocks
            assert a.block_table(rid).num_computed_tokens == 40
            # B's own s1, admitted with the very same prompt: a request of its own (not
            # a repeat of A's admission answered with A's blocks).
            (b_admitted,) = b.step().allocate(rid, prompt, 40, start=RequestStart()).send()
            assert b_admitted.ok and b_admitted.num_cached_tokens == 32
            assert _live_ids(server, rid) == {
                scoped_request_id(rid, "engine-a"),
                scoped_request_id(rid, "engine-b"),
            }
            (extended,) = a.step().allocate(rid, [1], 1).send()
            assert extended.ok and extended.num_computed_tokens == 41
            assert b.block_table(rid).num_computed_tokens == 40
            (preempted,) = b.step().preempt(rid).send()
            assert preempted.num_freed_blocks > 0
            assert a.block_table(rid).num_computed_tokens == 41
            with pytest.raises(NotFoundError):
                b.block_table(rid)
            (freed,) = a.step().free(rid).send()
            assert freed.num_freed_blocks > 0
            assert _live_ids(server, rid) == set()
        finally:
            for client in (a, b):
                client.step().free(rid).send()


def test_call_ids_are_per_engine(server: ServerThread) -> None:
    """Two engines that send the same call id get their own replies: a repeat is one of
    the caller's own calls, never another engine's reply (its block ids) answered back."""

    def admit(token: str, prompt: list[int]) -> kvcache_pb2.AllocateResponse:
        request = kvcache_pb2.AllocateRequest(
            pool="p", request_id="c1", new_token_ids=prompt, num_new_tokens=len(prompt),
            call_id="same-call-id",
        )  # fmt: skip
        request.start.SetInParent()
        with grpc.insecure_channel(server.address) as channel:
            return kvcache_pb2_grpc.KVCacheServiceStub(channel).Allocate(  # type: ignore[no-any-return]
                request, metadata=_metadata(token), timeout=5
            )

    first = admit(ENGINE_A, list(range(4000, 4040)))
    other = admit(ENGINE_B, list(range(5000, 5020)))
    with _engine(server, ENGINE_A) as a, _engine(server, ENGINE_B) as b:
        try:
            assert first.num_computed_tokens == 40 and other.num_computed_tokens == 20
            assert b.block_table("c1").num_tokens == 20
            assert a.block_table("c1").num_tokens == 40
        finally:
            a.free("c1")
            b.free("c1")


@pytest.mark.parametrize("request_id", ["r1", 'say "hi"\\now', "é-ü", "x" * 256])
def test_the_namespace_prefix_leaves_quoted_ids_however_they_are_quoted(request_id: str) -> None:
    """Messages quote ids with kvsvc.errors.quoted (JSON: NUL is \\u0000), repr (\\x00) or
    not at all; each way the engine reads back the id it sent, quoted the same way."""
    engine = "engine-a"
    scoped = scoped_request_id(request_id, engine)
    message = f"request {quoted(scoped)} is not live in this pool"
    assert (
        unscope_message(message, engine) == f"request {quoted(request_id)} is not live in this pool"
    )
    assert unscope_message(f"[{scoped!r}]", engine) == f"[{request_id!r}]"
    assert unscope_message(scoped, engine) == request_id
    # Another engine's ids (and the default namespace's messages) are left as they are.
    other = quoted(scoped_request_id(request_id, "engine-b"))
    assert unscope_message(other, engine) == other
    assert unscope_message(message, "") == message


def test_a_request_id_cannot_forge_a_namespace(server: ServerThread) -> None:
    with (
        _engine(server, ENGINE_ANON) as anon,
        pytest.raises(InvalidArgumentError, match="must not contain a NUL"),
    ):
        anon.allocate("engine-a\x00r1", [1, 2, 3], 3, start=RequestStart())


def test_an_engine_cannot_read_another_engines_prompts_through_a_stream(
    server: ServerThread,
) -> None:
    """Engine A admits a prompt under its own salt and adapter. Engine B (another named
    engine) can follow neither the events (a BlockStored carries A's token ids and LoRA
    name) nor the index snapshot: both are refused PERMISSION_DENIED, saying why and
    which token may. The operator's token (what kvsvc indexer and kvsvc ctl events use)
    reads the whole stream."""
    secret = list(range(5000, 5048))
    hashing = HashingContext(cache_salt="salt-of-a", lora_name="adapter-of-a")
    with _engine(server, ENGINE_A) as a, _engine(server, ENGINE_B) as b:
        assert a.allocate("secret", secret, 48, start=RequestStart(hashing=hashing)).ok
        try:
            with pytest.raises(PermissionDeniedError) as refused:
                next(iter(b.watch_events(1, reconnect=False)))
            assert "operator" in refused.value.details
            assert "token ids" in refused.value.details
            with grpc.insecure_channel(server.address) as channel:
                snapshot = kvcache_pb2_grpc.KVCacheServiceStub(channel).SnapshotIndex(
                    kvcache_pb2.SnapshotIndexRequest(pool="p"),
                    metadata=(("authorization", f"Bearer {ENGINE_B}"),),
                    timeout=5,
                )
                with pytest.raises(grpc.RpcError) as denied:
                    next(snapshot)
                assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with _engine(server, ADMIN) as operator:
                stored = [
                    event
                    for batch in _until_caught_up(operator)
                    for event in batch.events
                    if isinstance(event, BlockStored)
                ]
            assert any(e.lora_name == "adapter-of-a" and e.token_ids[0] == 5000 for e in stored)
        finally:
            a.free("secret")


def _until_caught_up(client: KVCacheClient) -> list[EventBatch]:
    batches = []
    for batch in client.watch_events(1, caught_up=True, reconnect=False):
        if batch.caught_up:
            return batches
        batches.append(batch)
    raise AssertionError("the stream ended before it caught up")


@pytest.mark.parametrize("token", [None, "not-a-token-0123456789", ENGINE_A, ADMIN])
def test_an_unknown_method_is_unimplemented_whoever_asks(
    server: ServerThread, token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """``/kvsvc.v1.<Service>/Nope``, unary or streaming, without a token, with an unknown
    one or with a role's: UNIMPLEMENTED (the interceptor has no handler to refuse or to
    wrap), and no traceback in the log."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    with grpc.insecure_channel(server.address) as channel:
        for service in SERVICES:
            path = f"/{service.full_name}/Nope"
            with pytest.raises(grpc.RpcError) as unary:
                channel.unary_unary(path)(b"", metadata=metadata, timeout=5)
            assert unary.value.code() == grpc.StatusCode.UNIMPLEMENTED
            stream = channel.unary_stream(path)(b"", metadata=metadata, timeout=5)
            with pytest.raises(grpc.RpcError) as streaming:
                next(stream)
            assert streaming.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_agent_token_cannot_drive_the_engine_api(server: ServerThread) -> None:
    with (
        KVCacheClient(server.address, pool="p", options=ClientOptions(token=AGENT)) as agent,
        pytest.raises(PermissionDeniedError, match="engine"),
    ):
        agent.allocate("x", [1, 2], 2, start=RequestStart())
    with (
        KVCacheClient(server.address, pool="p", options=ClientOptions(token="")) as anon,
        pytest.raises(UnauthenticatedError, match="missing"),
    ):
        anon.usage()


def test_token_files_are_parsed_strictly(tmp_path: Path) -> None:
    assert read_token_file(_write(tmp_path / "a", f"# c\n\n e1 {ENGINE_A} \n"), "engine") == [
        ("e1", ENGINE_A, None, f"engine token file {tmp_path / 'a'}, line 3")
    ]
    with pytest.raises(ConfigError, match="holds no token"):
        read_token_file(_write(tmp_path / "b", "# nothing\n\n"), "agent")
    with pytest.raises(ConfigError, match="line 1: expected 'TOKEN'"):
        read_token_file(_write(tmp_path / "c", f"name {AGENT}\n"), "agent")
    with pytest.raises(ConfigError, match="engine name"):
        read_token_file(_write(tmp_path / "d", f"bad/name {ENGINE_A}\n"), "engine")
    scoped = read_token_file(
        _write(tmp_path / "s", f"{ENGINE_A} pools=p\ne2 {ENGINE_B} pools=p,q\n"), "engine"
    )
    assert [(t.engine, t.token, t.pools) for t in scoped] == [
        ("", ENGINE_A, frozenset({"p"})),
        ("e2", ENGINE_B, frozenset({"p", "q"})),
    ]
    for bad in (f"{ENGINE_A} pools=", f"{ENGINE_A} pools=p,,q", f"pools=p {ENGINE_A}"):
        with pytest.raises(ConfigError, match=r"line 1: .*pools="):
            read_token_file(_write(tmp_path / "bad", bad + "\n"), "engine")
    with pytest.raises(ConfigError, match="line 1: expected 'TOKEN'"):
        read_token_file(_write(tmp_path / "ap", f"{AGENT} pools=p\n"), "agent")
    with pytest.raises(ConfigError, match="'nope', which the server does not serve"):
        load_credentials(
            ServerConfig(
                pools=(PoolConfig(name="p"),),
                engine_token_file=_write(tmp_path / "u", f"{ENGINE_A} pools=p,nope\n"),
            )
        )
    inline = ServerConfig(
        pools=(PoolConfig(name="p"), PoolConfig(name="q")),
        engine_token=ENGINE_A,
        engine_token_pools="q",  # type: ignore[arg-type]
    )
    assert load_credentials(inline).lookup(f"Bearer {ENGINE_A}") == Credential(
        frozenset({Role.ENGINE}), source="engine_token", pools=frozenset({"q"})
    )
    with pytest.raises(ConfigError, match="engine_token_pools names 'r'"):
        ServerConfig(
            pools=(PoolConfig(name="p"),), engine_token=ENGINE_A, engine_token_pools=("r",)
        )
    with pytest.raises(ConfigError, match="engine_token_pools scopes engine_token"):
        ServerConfig(pools=(PoolConfig(name="p"),), engine_token_pools=("p",))
    with pytest.raises(ConfigError, match="No such file"):
        read_token_file(str(tmp_path / "missing"), "admin")
    pools = (PoolConfig(name="p"),)
    with pytest.raises(ConfigError, match="at least 16 characters"):
        load_credentials(ServerConfig(pools=pools, auth_token="short"))
    with pytest.raises(ConfigError, match="also configured as"):
        load_credentials(ServerConfig(pools=pools, engine_token=ENGINE_A, agent_token=ENGINE_A))
    credentials = load_credentials(
        ServerConfig(pools=pools, engine_token_file=_write(tmp_path / "e", f"e1 {ENGINE_A}\n"))
    )
    assert credentials.lookup(f"Bearer {ENGINE_A}") == Credential(
        frozenset({Role.ENGINE}), "e1", "engine_token_file (engine e1)"
    )
    assert credentials.lookup(f"Bearer {ENGINE_A}x") is None


def test_serve_refuses_an_unreadable_token_file(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsvc",
            "serve",
            "--pool",
            "p",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "off",
            "--agent-token-file",
            str(tmp_path / "missing"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "agent token file" in result.stderr and "missing" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_clients_resolve_their_role_token_in_order(tmp_path: Path) -> None:
    path = _write(tmp_path / "t", f"# mine\n{AGENT}\n")
    env = {"KVSVC_AUTH_TOKEN": ALL_ROLES, "KVSVC_ADMIN_TOKEN_FILE": path}
    assert resolve_token("engine", environ=env) == ALL_ROLES
    assert resolve_token("admin", environ=env) == AGENT
    assert resolve_token("engine", environ={**env, "KVSVC_ENGINE_TOKEN": ENGINE_B}) == ENGINE_B
    assert resolve_token("agent", token_file=path, environ=env) == AGENT
    assert resolve_token("agent", token="", environ=env) is None
    assert resolve_token("agent", environ={}) is None
    # An indexer reads its own role's token, never the operator's.
    assert resolve_token("indexer", environ=env) == ALL_ROLES
    assert resolve_token("indexer", environ={**env, "KVSVC_INDEXER_TOKEN": INDEXER}) == INDEXER
    with pytest.raises(ValueError, match="role"):
        resolve_token("router")


def _peak_rss_mib(pid: int) -> int:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_refused_call_is_answered_before_its_message_is_read(tmp_path: Path) -> None:
    """An unauthenticated caller cannot make the server hold its messages: the refusal
    goes out before the message arrives, so four concurrent 48 MiB calls (192 MiB a
    server that read them first would hold at once) leave its peak memory almost where
    it was."""
    import threading

    from kvsvc.demo.processes import spawn, stop_all, wait_for_ports

    token_file = tmp_path / "tokens"
    token_file.write_text(ALL_ROLES + "\n")
    args = ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p"]
    args += ["--auth-token-file", str(token_file), "--log-level", "ERROR"]
    server = spawn("server", args)
    try:
        port, _ = wait_for_ports(server)
        limit = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=limit) as channel:
            allocate = channel.unary_unary("/kvsvc.v1.KVCacheService/Allocate")
            watch = channel.unary_stream("/kvsvc.v1.KVCacheService/WatchEvents")
            with pytest.raises(grpc.RpcError) as small:
                allocate(b"", timeout=10)
            assert small.value.code() == grpc.StatusCode.UNAUTHENTICATED
            before = _peak_rss_mib(server.process.pid)
            big = b"\x12" + b"\xff" * (48 << 20)  # one field's bytes: never parsed
            codes: list[grpc.StatusCode] = []

            def refused(call: Any) -> None:
                try:
                    result = call(big, timeout=30)
                    if not isinstance(result, bytes):  # a stream: its first message
                        next(iter(result))
                except grpc.RpcError as exc:
                    codes.append(exc.code())

            threads = [
                threading.Thread(target=refused, args=(call,))
                for call in (allocate, allocate, allocate, watch)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
            grown = _peak_rss_mib(server.process.pid) - before
            assert grown < 64, f"the server's peak memory grew {grown} MiB for refused calls"
    finally:
        stop_all([server])
