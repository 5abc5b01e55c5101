"""``ClusterIndexService`` over gRPC (``kvsvc router``), and its Python client.

The servicer is a thin adapter over :class:`kvsvc.cluster.score.Scorer`: it decodes the
prompt (repeated or packed ids) and the hashing context with the server's own wire
functions, scores, and answers every engine highest first.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Collection, Sequence
from concurrent import futures
from typing import Any

import grpc

from kvsvc.cluster.score import MAX_SCORE_TOKENS, Scorer
from kvsvc.errors import InvalidArgument
from kvsvc.ports import ListenError
from kvsvc.tls import ClientTls, ServerTls, ServerTlsSource, open_channel
from kvsvc.v1 import cluster_pb2, cluster_pb2_grpc

_log = logging.getLogger("kvsvc.cluster")

SERVICE = cluster_pb2.DESCRIPTOR.services_by_name["ClusterIndexService"].full_name
HEALTH_SERVICE = "grpc.health.v1.Health"
# Score calls served at once (each a thread: hashing is CPU, Redis a round trip).
ROUTER_THREADS = 8
SCORE_TIMEOUT_S = 10.0
# Largest Score request the router reads: the longest prompt it takes (MAX_SCORE_TOKENS)
# as token_ids (varints, up to 5 bytes each for ids below 2^31; packed: 4 bytes), plus
# room for the hashing context and the engine names. gRPC's default (4 MiB) was below
# the prompt alone: the documented bound could not be reached.
ROUTER_MAX_MESSAGE_BYTES = 5 * MAX_SCORE_TOKENS + (4 << 20)


class ScoreServicer(cluster_pb2_grpc.ClusterIndexServiceServicer):
    """Answers Score from the index; Redis errors are UNAVAILABLE, bad input
    INVALID_ARGUMENT naming the field."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def Score(self, request: Any, context: Any) -> cluster_pb2.ScoreResponse:
        import redis

        from kvsvc.server.wire import hashing_from_pb, token_ids_of

        try:
            if len(request.packed_token_ids) // 4 > MAX_SCORE_TOKENS:
                raise InvalidArgument("packed_token_ids", f"more than {MAX_SCORE_TOKENS} tokens")
            tokens = token_ids_of(
                request.token_ids, request.packed_token_ids, "token_ids", "packed_token_ids"
            )
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
    scorer: Scorer, listen: str, tokens: Sequence[str] = (), tls: ServerTls | None = None
) -> tuple[grpc.Server, int]:
    """A started gRPC server with ClusterIndexService and health; ``(server, port)``.

    Args:
        scorer: what answers Score.
        listen: ``HOST:PORT`` (port 0: any free one).
        tokens: bearer tokens a caller must send one of (none: open).
        tls: the listener's certificate (re-read when its files change; a client CA
            makes it mTLS); None: plaintext.

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
            ScoreServicer(scorer),
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
        from kvsvc_client._wire import hashing_to_pb, pack_token_ids
        from kvsvc_client.errors import error_from_rpc

        request = cluster_pb2.ScoreRequest(engines=list(engines))
        packed = pack_token_ids(token_ids)
        if packed is not None:
            request.packed_token_ids = packed
        else:
            request.token_ids.extend(token_ids)
        pb_hashing = hashing_to_pb(hashing)
        if pb_hashing is not None:
            request.hashing.CopyFrom(pb_hashing)
        try:
            response = self._stub.Score(
                request, timeout=timeout or self.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return {s.engine: s.num_cached_tokens for s in response.scores}
