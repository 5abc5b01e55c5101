"""The router's prompt bound is reachable (issue 22, item 13): Score takes 2^20 tokens
(MAX_SCORE_TOKENS), packed or not, and refuses one more with INVALID_ARGUMENT. gRPC's
default 4 MiB receive limit was hit first (2^20 packed tokens are 4 MiB before the rest
of the message), so the documented bound answered RESOURCE_EXHAUSTED instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvsvc.cluster.score import MAX_SCORE_TOKENS
from kvsvc.v1 import cluster_pb2, cluster_pb2_grpc
from tests.cluster.redis_procs import RedisServer, require_redis_package

require_redis_package()


@pytest.fixture()
def router(tmp_path: Path) -> Iterator[str]:
    from kvsvc.cluster.router import create_router
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    redis = RedisServer(tmp_path / "redis")
    redis.start()
    server, port = create_router(Scorer(connect(redis.url), "seed"), "127.0.0.1:0")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
        redis.stop()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "varints"])
def test_score_takes_the_documented_longest_prompt(router: str, packed: bool) -> None:
    tokens = [2**31 - 1] * MAX_SCORE_TOKENS  # the longest varints there are
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(router, options=options) as channel:
        stub = cluster_pb2_grpc.ClusterIndexServiceStub(channel)

        def request(n: int) -> cluster_pb2.ScoreRequest:
            if packed:
                data = (2**31 - 1).to_bytes(4, "little") * n
                return cluster_pb2.ScoreRequest(packed_token_ids=data)
            return cluster_pb2.ScoreRequest(
                token_ids=tokens[:n] if n <= len(tokens) else [*tokens, 1]
            )

        assert list(stub.Score(request(MAX_SCORE_TOKENS), timeout=60).scores) == []
        with pytest.raises(grpc.RpcError) as refused:
            stub.Score(request(MAX_SCORE_TOKENS + 1), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_SCORE_TOKENS) in (refused.value.details() or "")


def test_route_takes_its_documented_bounds_together(router: str) -> None:
    """The longest prompt as varints with the most candidates of the longest names fits
    the router's request size; one candidate more, or one hash more, is INVALID_ARGUMENT
    naming the field (no engine is indexed: a request within the bounds is
    FAILED_PRECONDITION, which says it was read and checked)."""
    from kvsvc.cluster.route import MAX_ENGINE_NAME_BYTES, MAX_ROUTE_CANDIDATES
    from kvsvc.cluster.score import MAX_HASH_BYTES, MAX_PROMPT_HASHES

    names = [f"{i:08d}".ljust(MAX_ENGINE_NAME_BYTES, "x") for i in range(MAX_ROUTE_CANDIDATES)]
    tokens = [2**31 - 1] * MAX_SCORE_TOKENS
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(router, options=options) as channel:
        stub = cluster_pb2_grpc.ClusterIndexServiceStub(channel)

        def code(request: cluster_pb2.RouteRequest) -> tuple[grpc.StatusCode, str]:
            try:
                reply = stub.Route(request, timeout=60)
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""
            return grpc.StatusCode.OK, str(reply.num_candidates)

        at_bound = cluster_pb2.RouteRequest(token_ids=tokens, engines=names)
        at_bound.hashing.lora_name = "l" * 256
        assert code(at_bound) == (grpc.StatusCode.OK, str(MAX_ROUTE_CANDIDATES))
        past = code(cluster_pb2.RouteRequest(token_ids=tokens[:64], engines=[*names, "y:1/p"]))
        assert past[0] == grpc.StatusCode.INVALID_ARGUMENT and "engines" in past[1]
        long_name = code(cluster_pb2.RouteRequest(token_ids=[1, 2], engines=["n" * 257]))
        assert long_name[0] == grpc.StatusCode.INVALID_ARGUMENT and "engines[0]" in long_name[1]
        hashes = [b"h" * MAX_HASH_BYTES] * MAX_PROMPT_HASHES
        request = cluster_pb2.RouteRequest(
            block_hashes=hashes, block_size=16, num_prompt_tokens=16 * MAX_PROMPT_HASHES
        )
        assert code(request)[0] == grpc.StatusCode.FAILED_PRECONDITION
        request.block_hashes.append(b"h")
        request.num_prompt_tokens += 16
        past = code(request)
        assert past[0] == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes" in past[1]
