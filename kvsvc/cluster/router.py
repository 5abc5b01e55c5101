"""``ClusterIndexService`` over gRPC (``kvsvc router``), and its Python client.

The servicer is a thin adapter over :class:`kvsvc.cluster.score.Scorer` (Score) and
:class:`kvsvc.cluster.route.Router` (Route): it decodes the prompt (repeated or packed ids,
or block hashes) and the hashing context with the server's own wire functions, and
answers Score's engines highest first, Route's chosen engine and runner-up.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Collection, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from kvsvc.cluster.route import RoutePolicy, Router, RouteResult
from kvsvc.cluster.score import MAX_SCORE_TOKENS, HashesPrompt, Prompt, Scorer, TokenPrompt
from kvsvc.errors import FailedPrecondition, InvalidArgument
from kvsvc.ports import ListenError
from kvsvc.tls import ClientTls, ServerTls, ServerTlsSource, open_channel
from kvsvc.v1 import cluster_pb2, cluster_pb2_grpc

_log = logging.getLogger("kvsvc.cluster")

SERVICE = cluster_pb2.DESCRIPTOR.services_by_name["ClusterIndexService"].full_name
HEALTH_SERVICE = "grpc.health.v1.Health"
# Score calls served at once (each a thread: hashing is CPU, Redis a round trip).
ROUTER_THREADS = 8
SCORE_TIMEOUT_S = 10.0
# Largest Score or Route request the router reads: the longest prompt it takes
# (MAX_SCORE_TOKENS) as token_ids (varints, up to 5 bytes each for ids below 2^31;
# packed: 4 bytes), plus room for the hashing context (4 MiB) and Route's candidates
# (MAX_ROUTE_CANDIDATES names of MAX_ENGINE_NAME_BYTES: 4 MiB, with their tags). gRPC's
# default (4 MiB) was below the prompt alone: the documented bound could not be reached.
ROUTER_MAX_MESSAGE_BYTES = 5 * MAX_SCORE_TOKENS + (9 << 20)


def _token_ids(request: Any) -> Sequence[int]:
    from kvsvc.server.wire import token_ids_of

    if len(request.packed_token_ids) // 4 > MAX_SCORE_TOKENS:
        raise InvalidArgument("packed_token_ids", f"more than {MAX_SCORE_TOKENS} tokens")
    return token_ids_of(
        request.token_ids, request.packed_token_ids, "token_ids", "packed_token_ids"
    )


def route_prompt(request: Any) -> Prompt:
    """A RouteRequest's prompt: its token ids (and hashing context), or its block hashes.

    Raises:
        InvalidArgument: both forms or neither, or a bad field of either (named).
    """
    from kvsvc.server.wire import hashing_from_pb

    if request.block_hashes:
        if request.token_ids or request.packed_token_ids:
            raise InvalidArgument("block_hashes", "give token ids or block hashes, not both")
        if request.HasField("hashing"):
            raise InvalidArgument(
                "hashing", "block hashes carry their hashing context already: give none"
            )
        return HashesPrompt(
            list(request.block_hashes), request.block_size, request.num_prompt_tokens
        )
    if request.block_size:
        raise InvalidArgument("block_size", "only with block_hashes")
    tokens = _token_ids(request)
    if request.num_prompt_tokens and request.num_prompt_tokens != len(tokens):
        raise InvalidArgument(
            "num_prompt_tokens",
            f"{request.num_prompt_tokens} but {len(tokens)} token ids (leave it 0 with token ids)",
        )
    return TokenPrompt(tokens, hashing_from_pb(request.hashing, "hashing"))


def policy_from_pb(message: Any) -> RoutePolicy:
    """A RoutePolicy message as the router's policy (checked; fields named ``policy.*``)."""
    return RoutePolicy(message.prefix_weight, message.load_weight, message.load_floor).check()


def policy_to_pb(policy: RoutePolicy) -> cluster_pb2.RoutePolicy:
    return cluster_pb2.RoutePolicy(
        prefix_weight=policy.prefix_weight,
        load_weight=policy.load_weight,
        load_floor=policy.load_floor,
    )


_TERMS = {
    "prefix": cluster_pb2.ROUTE_TERM_PREFIX,
    "load": cluster_pb2.ROUTE_TERM_LOAD,
    "tie": cluster_pb2.ROUTE_TERM_TIE,
    "only": cluster_pb2.ROUTE_TERM_ONLY_CANDIDATE,
}


def route_response(result: RouteResult) -> cluster_pb2.RouteResponse:
    def candidate(c: Any) -> cluster_pb2.RouteCandidate:
        report = c.report
        load = cluster_pb2.EngineLoad(
            reported=report is not None,
            num_routed_since_report=c.routed_since,
            relative_load=c.relative,
            age_seconds=c.age_s,
        )
        if report is not None:
            load.num_running_requests = report.running
            load.num_used_blocks = report.used_blocks
            load.num_blocks = report.num_blocks
        return cluster_pb2.RouteCandidate(
            engine=c.engine, num_cached_tokens=c.cached, load=load, score=c.score
        )

    response = cluster_pb2.RouteResponse(
        chosen=candidate(result.chosen),
        decided_by=_TERMS[result.decided_by],
        num_prompt_tokens=result.num_prompt_tokens,
        num_candidates=result.num_candidates,
        seed_mismatch=list(result.seed_mismatch),
        upper_bound=list(result.upper_bound),
        policy=policy_to_pb(result.policy),
    )
    if result.runner_up is not None:
        response.runner_up.CopyFrom(candidate(result.runner_up))
    return response


class ScoreServicer(cluster_pb2_grpc.ClusterIndexServiceServicer):
    """Answers Score and Route from the index; Redis errors are UNAVAILABLE, bad input
    INVALID_ARGUMENT naming the field.

    Args:
        scorer: the index's scorer.
        router: Route's policy and its routed-since counts (None: one with the default
            weights over ``scorer``).
    """

    def __init__(self, scorer: Scorer, router: Router | None = None) -> None:
        self.scorer = scorer
        self.router = router or Router(scorer)

    def Route(self, request: Any, context: Any) -> cluster_pb2.RouteResponse:
        import redis

        try:
            prompt = route_prompt(request)
            policy = policy_from_pb(request.policy) if request.HasField("policy") else None
            result = self.router.route(prompt, list(request.engines) or None, policy)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except FailedPrecondition as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except redis.exceptions.RedisError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the index's Redis: {exc}")
        return route_response(result)

    def Score(self, request: Any, context: Any) -> cluster_pb2.ScoreResponse:
        import redis

        from kvsvc.server.wire import hashing_from_pb

        try:
            tokens = _token_ids(request)
            hashing = hashing_from_pb(request.hashing, "hashing")
            result = self.scorer.score(tokens, hashing, set(request.engines) or None)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except redis.exceptions.RedisError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the index's Redis: {exc}")
        ranked = sorted(result.scores.items(), key=lambda item: (-item[1], item[0]))
        return cluster_pb2.ScoreResponse(
            scores=[cluster_pb2.EngineScore(engine=e, num_cached_tokens=n) for e, n in ranked],
            seed_mismatch=list(result.seed_mismatch),
            upper_bound=list(result.upper_bound),
        )


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses calls without one of the router's bearer tokens (UNAUTHENTICATED)."""

    def __init__(self, tokens: Sequence[str]) -> None:
        self._headers = [f"Bearer {t}".encode() for t in tokens]

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        found = False
        for header in self._headers:  # every one compared: the time says nothing
            found |= hmac.compare_digest(given, header)
        if found or handler_call_details.method.startswith("/grpc."):
            return continuation(handler_call_details)

        def deny(requests: Any, context: Any) -> None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or unknown token (expected 'Bearer <token>' of the router's --token-file)",
            )

        # Request-streaming and never read: the refusal goes out before the message
        # arrives (as the server's AuthInterceptor does), so an unauthenticated caller's
        # prompt is neither received in full nor parsed.
        return grpc.stream_unary_rpc_method_handler(deny, request_deserializer=bytes)


def create_router(
    scorer: Scorer,
    listen: str,
    tokens: Sequence[str] = (),
    tls: ServerTls | None = None,
    router: Router | None = None,
) -> tuple[grpc.Server, int]:
    """A started gRPC server with ClusterIndexService and health; ``(server, port)``.

    Args:
        scorer: what answers Score.
        listen: ``HOST:PORT`` (port 0: any free one).
        tokens: bearer tokens a caller must send one of (none: open).
        tls: the listener's certificate (re-read when its files change; a client CA
            makes it mTLS); None: plaintext.
        router: what answers Route (None: the default weights over ``scorer``).

    Raises:
        ListenError: the address cannot be bound (``kvsvc router`` checks it first, so
            only one taken since then meets gRPC's own failure).
        TlsFileError: the certificate files cannot be used.
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    interceptors = [_TokenCheck(tokens)] if tokens else []
    server = grpc.server(
        futures.ThreadPoolExecutor(ROUTER_THREADS, thread_name_prefix="kvsvc-router"),
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", ROUTER_MAX_MESSAGE_BYTES)],
    )
    from kvsvc.server.transports.gate import guard_malformed_sync
    from kvsvc.server.transports.grpc_listener import add_service, recorded_handlers

    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    # Every method answers a body that does not parse INVALID_ARGUMENT
    # (kvsvc.server.transports.gate).
    for service, add, servicer in (
        (
            SERVICE,
            cluster_pb2_grpc.add_ClusterIndexServiceServicer_to_server,
            ScoreServicer(scorer, router),
        ),
        (HEALTH_SERVICE, health_pb2_grpc.add_HealthServicer_to_server, health_servicer),
    ):
        handlers = guard_malformed_sync(service, recorded_handlers(add, servicer))
        add_service(server, service, handlers)
    try:
        if tls is not None:
            port = server.add_secure_port(listen, ServerTlsSource(tls).grpc_credentials())
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:  # gRPC's "Failed to bind to address"
        port = 0
    if not port:
        server.stop(None)
        raise ListenError(listen, "router gRPC", "--listen", "the address cannot be bound")
    server.start()
    return server, port


class ClusterIndexClient:
    """A router's client of ``kvsvc router`` (ClusterIndexService).

    Example::

        with ClusterIndexClient("router:50061") as index:
            scores = index.score(prompt_ids)   # {"10.0.0.5:50051/llama": 2048, ...}
            best = next(iter(scores))          # the engine with the longest cached prefix

    Args:
        target: the router's ``HOST:PORT``.
        token: a bearer token of the router's ``--token-file`` (None: send none).
        timeout: deadline of each call, seconds.
        tls: a :class:`kvsvc.tls.ClientTls` (``kvsvc.tls.client_tls(ca, cert, key)``) for
            a router started with ``--tls-cert``; None: plaintext.

    Raises:
        TlsError: inconsistent TLS settings; TlsFileError: a TLS file cannot be read.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 5.0,
        tls: ClientTls | None = None,
    ) -> None:
        self._channel = open_channel(target, tls)
        self._stub = cluster_pb2_grpc.ClusterIndexServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.timeout = timeout

    def __enter__(self) -> ClusterIndexClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def score(
        self,
        token_ids: Sequence[int],
        *,
        hashing: Any = None,
        engines: Collection[str] = (),
        timeout: float | None = None,
    ) -> dict[str, int]:
        """Cached prefix tokens per engine, highest first (every indexed engine, or the
        ``engines`` named that are indexed).

        Args:
            token_ids: the prompt.
            hashing: a :class:`kvsvc_client.HashingContext` (salt, LoRA, multimodal items).
            engines: candidates, as ``HOST:PORT/POOL``.

        Raises:
            kvsvc_client.KVCacheError: the call failed (InvalidArgumentError naming the
                field, UnavailableError when the router or its Redis is down, ...).
        """
        from kvsvc_client.errors import error_from_rpc

        request = cluster_pb2.ScoreRequest(engines=list(engines))
        _put_prompt(request, token_ids, hashing)
        try:
            response = self._stub.Score(
                request, timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return {s.engine: s.num_cached_tokens for s in response.scores}

    def route(
        self,
        token_ids: Sequence[int] = (),
        *,
        hashing: Any = None,
        block_hashes: Sequence[bytes] = (),
        block_size: int = 0,
        num_prompt_tokens: int = 0,
        engines: Collection[str] = (),
        policy: RoutePolicy | None = None,
        timeout: float | None = None,
    ) -> RouteAnswer:
        """The engine a prompt should go to (ClusterIndexService.Route).

        Args:
            token_ids: the prompt (or give ``block_hashes``).
            hashing: a :class:`kvsvc_client.HashingContext` (with token ids).
            block_hashes: instead of token ids, the hashes the engines index for the
                prompt's full blocks of ``block_size`` tokens, with ``num_prompt_tokens``.
            engines: candidates, as ``HOST:PORT/POOL`` (empty: every indexed engine).
            policy: weights for this call (None: the router's).

        Raises:
            kvsvc_client.KVCacheError: the call failed (InvalidArgumentError naming the
                field, FailedPreconditionError when there is no engine to choose,
                UnavailableError when the router or its Redis is down, ...).
        """
        from kvsvc_client.errors import error_from_rpc

        request = cluster_pb2.RouteRequest(
            engines=list(engines),
            block_hashes=list(block_hashes),
            block_size=block_size,
            num_prompt_tokens=num_prompt_tokens,
        )
        _put_prompt(request, token_ids, hashing)
        if policy is not None:
            request.policy.CopyFrom(policy_to_pb(policy))
        try:
            response = self._stub.Route(
                request, timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return RouteAnswer.from_pb(response)


def _put_prompt(request: Any, token_ids: Sequence[int], hashing: Any) -> None:
    """Score's and Route's prompt: its token ids (packed when they fit, as the engines'
    clients send them) and its hashing context."""
    from kvsvc_client._wire import hashing_to_pb, pack_token_ids

    if token_ids:
        packed = pack_token_ids(token_ids)
        if packed is not None:
            request.packed_token_ids = packed
        else:
            request.token_ids.extend(token_ids)
    pb_hashing = hashing_to_pb(hashing)
    if pb_hashing is not None:
        request.hashing.CopyFrom(pb_hashing)


@dataclass(frozen=True, slots=True)
class RoutedEngine:
    """One candidate of a Route answer (RouteCandidate).

    Attributes:
        engine: ``HOST:PORT/POOL``.
        num_cached_tokens: leading prompt tokens it has cached.
        reported: whether its server's load report was fresh (else the mean counted).
        num_running_requests / num_used_blocks / num_blocks: that report.
        num_routed_since_report: prompts the router sent it since.
        relative_load: the load weighed, over max(mean, load_floor).
        score: what Route maximised.
    """

    engine: str
    num_cached_tokens: int
    reported: bool
    num_running_requests: int
    num_used_blocks: int
    num_blocks: int
    num_routed_since_report: int
    relative_load: float
    score: float

    @classmethod
    def from_pb(cls, c: Any) -> RoutedEngine:
        load = c.load
        return cls(
            c.engine,
            c.num_cached_tokens,
            load.reported,
            load.num_running_requests,
            load.num_used_blocks,
            load.num_blocks,
            load.num_routed_since_report,
            load.relative_load,
            c.score,
        )


_TERM_NAMES = {value: name for name, value in _TERMS.items()}


@dataclass(frozen=True, slots=True)
class RouteAnswer:
    """Route's answer (RouteResponse).

    Attributes:
        chosen: the engine to send the prompt to.
        runner_up: the best of the others (None with one candidate).
        decided_by: ``"prefix"``, ``"load"``, ``"tie"`` or ``"only"``.
        num_prompt_tokens / num_candidates: the prompt's length, the engines weighed.
        policy: the weights used.
    """

    chosen: RoutedEngine
    runner_up: RoutedEngine | None
    decided_by: str
    num_prompt_tokens: int
    num_candidates: int
    policy: RoutePolicy
    seed_mismatch: tuple[str, ...] = ()
    upper_bound: tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, response: Any) -> RouteAnswer:
        p = response.policy
        return cls(
            RoutedEngine.from_pb(response.chosen),
            RoutedEngine.from_pb(response.runner_up) if response.HasField("runner_up") else None,
            _TERM_NAMES.get(response.decided_by, "unspecified"),
            response.num_prompt_tokens,
            response.num_candidates,
            RoutePolicy(p.prefix_weight, p.load_weight, p.load_floor),
            tuple(response.seed_mismatch),
            tuple(response.upper_bound),
        )
