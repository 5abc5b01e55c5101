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
