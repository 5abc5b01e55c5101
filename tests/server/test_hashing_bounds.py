"""Hashing-context strings are bounded in bytes on every path, and one Step's events never
make a message a subscriber with default limits cannot receive.

A 1 MiB ``lora_name`` once made one Step's event batch 314 MB (the name is copied into
every stored block's event) and ended every subscriber's stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from kvsvc_client import (
    ClientOptions,
    HashingContext,
    InvalidArgumentError,
    KVCacheClient,
    OperationError,
    RequestStart,
)

from kvsvc.cluster.router import create_router
from kvsvc.cluster.score import Scorer
from kvsvc.core import MAX_HASHING_STRING_BYTES, MAX_LORA_PATH_BYTES
from kvsvc.core.events import MAX_BATCH_WIRE_BYTES
from kvsvc.server.config import PoolConfig
from kvsvc.v1 import cluster_pb2, cluster_pb2_grpc, kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import ServerThread, bring_up, llama_like_specs, running_server

MIB = 1 << 20
MAX_MODEL_LEN = 65_536
BLOCK_SIZE = 64
# 4 layers x 2 heads x (64 + 64) x fp16 per token.
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * BLOCK_SIZE
NUM_BLOCKS = 24_000
# Case -> (the field, a value just over its bound, a value at it). Strings are bounded in
# UTF-8 bytes: two- and four-byte characters (65 emoji are 260 bytes in 65 characters).
OVERSIZED: dict[str, tuple[str, HashingContext, HashingContext]] = {
    "lora_name": (
        "lora_name",
        HashingContext(lora_name="n" * MIB),
        HashingContext(lora_name="n" * 256),
    ),
    "cache_salt": (
        "cache_salt",
        HashingContext(cache_salt="\u00e9" * (MAX_HASHING_STRING_BYTES // 2 + 1)),
        HashingContext(cache_salt="\u00e9" * (MAX_HASHING_STRING_BYTES // 2)),
    ),
    "cache_salt-4-byte-characters": (
        "cache_salt",
        HashingContext(cache_salt="\U0001f600" * (MAX_HASHING_STRING_BYTES // 4 + 1)),
        HashingContext(cache_salt="\U0001f600" * (MAX_HASHING_STRING_BYTES // 4)),
    ),
    "lora_path": (
        "lora_path",
        HashingContext(lora_name="a", lora_path="/" * (MAX_LORA_PATH_BYTES + 1)),
        HashingContext(lora_name="a", lora_path="/" * MAX_LORA_PATH_BYTES),
    ),
    "prompt_embeds_digests[1]": (
        "prompt_embeds_digests[1]",
        HashingContext(prompt_embeds_digests=(b"d", b"d" * (MAX_HASHING_STRING_BYTES + 1))),
        HashingContext(prompt_embeds_digests=(b"d", b"d" * MAX_HASHING_STRING_BYTES)),
    ),
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pool = PoolConfig(name="p", max_model_len=MAX_MODEL_LEN, max_requests=256)
    with running_server(pool, max_message_bytes=64 * MIB) as srv:
        ranks = bring_up(
            srv,
            "p",
            specs=llama_like_specs(block_size=BLOCK_SIZE),
            kv_cache_bytes=(NUM_BLOCKS + 1) * BYTES_PER_BLOCK,
        )
        yield srv
        for rank in ranks:
            rank.close()


def _state(server: ServerThread) -> tuple[int, int]:
    """The pool's live requests and last event sequence."""

    def read() -> tuple[int, int]:
        pool = server.server.pools.get("p")
        assert pool.cache is not None
        return pool.cache.num_requests, pool.events.last_sequence

    return server.run(read)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", list(OVERSIZED))
def test_an_oversized_hashing_string_is_refused_on_every_path_and_changes_nothing(
    server: ServerThread, case: str
) -> None:
    field, too_long, at_bound = OVERSIZED[case]
    # A request id of its own: a case that fails leaves no live request to the next.
    request = f"r{list(OVERSIZED).index(case)}"
    prompt = list(range(100, 100 + 2 * BLOCK_SIZE))
    before = _state(server)
    options = ClientOptions(retries=0, timeout=30)
    with KVCacheClient(server.address, pool="p", options=options) as kv:
        with pytest.raises(InvalidArgumentError, match=rf"start\.hashing\.{_re(field)}.*bytes"):
            kv.allocate(request, prompt, len(prompt), start=RequestStart(hashing=too_long))
        step = kv.step()
        step.allocate(request, prompt, len(prompt), start=RequestStart(hashing=too_long))
        outcome = _only(step.send())
        assert isinstance(outcome, OperationError), outcome
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"hashing.{field}" in outcome.message
        with pytest.raises(InvalidArgumentError, match=rf"hashing\.{_re(field)}.*bytes"):
            kv.lookup(prompt, too_long)
        assert _state(server) == before
        # At the bound it is served.
        assert kv.allocate(request, prompt, len(prompt), start=RequestStart(hashing=at_bound)).ok
        kv.free(request)


def test_the_router_refuses_an_oversized_lora_name_naming_it() -> None:
    """Score takes a hashing context too: the same bound, checked before the index (no
    Redis is reached: the client below points at nothing)."""
    import redis

    scorer = Scorer(redis.Redis(port=1, socket_connect_timeout=0.5), "seed")
    server, port = create_router(scorer, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cluster_pb2_grpc.ClusterIndexServiceStub(channel)
            request = cluster_pb2.ScoreRequest(token_ids=[1, 2, 3])
            request.hashing.lora_name = "n" * MIB
            with pytest.raises(grpc.RpcError) as refused:
                stub.Score(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "hashing.lora_name" in refused.value.details()
    finally:
        server.stop(None)


def test_a_worst_case_step_makes_batches_a_default_subscriber_receives(
    server: ServerThread,
) -> None:
    """One Step admits prompts of 5-byte token ids (the largest varints) under a LoRA name
    at its bound: ~1.2 M tokens, ~7 MB of events, past gRPC's default 4 MiB receive limit
    as one batch. A subscriber on a channel with gRPC's defaults receives all of it, in
    several consecutive batches each within MAX_BATCH_WIRE_BYTES."""
    lora = "L" * MAX_HASHING_STRING_BYTES
    prompts = 20
    length = 60_000
    with grpc.insecure_channel(server.address) as channel:  # gRPC's default limits
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        first = _state(server)[1] + 1
        options = ClientOptions(retries=0, timeout=120)
        with KVCacheClient(server.address, pool="p", options=options) as kv:
            step = kv.step()
            for i in range(prompts):
                tokens = [(1 << 30) + i * length + t for t in range(length)]
                hashing = HashingContext(lora_name=lora)
                step.allocate(f"w{i}", tokens, length, start=RequestStart(hashing=hashing))
            assert all(result.ok for result in step.send())  # type: ignore[union-attr]
            last = _state(server)[1]
            stream = stub.WatchEvents(
                kvcache_pb2.WatchEventsRequest(pool="p", from_sequence=first), timeout=60
            )
            stored_tokens = 0
            sizes = []
            try:
                for message in stream:
                    sizes.append(message.ByteSize())
                    stored_tokens += sum(len(e.stored.token_ids) for e in message.events)
                    if message.sequence == last:
                        break
            finally:
                stream.cancel()
            step = kv.step()
            for i in range(prompts):
                step.free(f"w{i}")
            step.send()
    assert len(sizes) > 1, "the Step's events fitted one batch: the test proves nothing"
    assert max(sizes) <= MAX_BATCH_WIRE_BYTES
    # Every full block of every prompt was stored, none lost to the split (the prompts'
    # last partial blocks are not full).
    assert stored_tokens == prompts * (length // BLOCK_SIZE) * BLOCK_SIZE


def _only(results: Any) -> Any:
    (result,) = results
    return result


def _re(field: str) -> str:
    return field.replace("[", r"\[").replace("]", r"\]")
