"""Two server-wide bounds of README's Limits table, hit against a real server.

* operations per ``Step`` (``max_step_operations``): one more than the bound rejects the
  whole call with ``INVALID_ARGUMENT`` naming the bound; none of its operations ran.
* message size (``max_message_bytes``): a request over it is ``RESOURCE_EXHAUSTED`` and
  changes nothing; one just under it is served.

(The per-pool bounds, request ids, max_model_len, Lookup and multimodal caps are in
test_bounds.py and test_request_id_bounds.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvsvc_client import InvalidArgumentError, KVCacheClient, ResourceExhaustedError

from kvsvc.server.config import PoolConfig
from tests.server.harness import (
    ServerThread,
    bring_up,
    llama_like_specs,
    running_server,
    tidy_client,
)

MAX_STEP_OPERATIONS = 8
MAX_MESSAGE_BYTES = 64 * 1024
# Packed token ids take 4 bytes each: this many make a message over the bound, and a
# prompt of UNDER_LIMIT tokens one under it.
OVER_LIMIT = MAX_MESSAGE_BYTES // 4 + 16
UNDER_LIMIT = MAX_MESSAGE_BYTES // 4 - 1024
MAX_MODEL_LEN = 32_768
# One tiny layer: 1 head x (8 + 8) x fp16 x 16 tokens = 512 B a block.
TINY_SPECS = llama_like_specs(num_layers=1, num_kv_heads=1, head_size=8)
NUM_BLOCKS = 3000


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    pool = PoolConfig(name="p", max_model_len=MAX_MODEL_LEN)
    with running_server(
        pool, max_step_operations=MAX_STEP_OPERATIONS, max_message_bytes=MAX_MESSAGE_BYTES
    ) as srv:
        ranks = bring_up(srv, specs=TINY_SPECS, kv_cache_bytes=NUM_BLOCKS * 512)
        yield srv
        for rank in ranks:
            rank.close()


@pytest.fixture()
def kv(server: ServerThread) -> Iterator[KVCacheClient]:
    with tidy_client(server) as client:
        yield client


def pool_state(server: ServerThread) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""

    def read() -> tuple[Any, ...]:
        pool = server.server.pools.by_name["p"]
        cache = pool.cache
        blocks = cache.manager.block_pool
        return (
            cache.request_ids(),
            blocks.free_queue.get_all_free_blocks(),
            list(blocks.ref_cnt),
            list(blocks.block_hash),
            cache.usage(),
        )

    return server.run(read)


def test_a_step_over_max_step_operations_is_refused_whole(
    server: ServerThread, kv: KVCacheClient
) -> None:
    assert kv.allocate("live", list(range(40)), 40, start=True).ok
    before = pool_state(server)
    step = kv.step()
    for i in range(MAX_STEP_OPERATIONS):
        step.allocate(f"new{i}", [i] * 20, 20, start=True)
    step.allocate("live", [1], 1)  # one more: the bound's + 1st operation
    with pytest.raises(InvalidArgumentError) as refused:
        step.send()
    message = refused.value.details
    assert f"{MAX_STEP_OPERATIONS + 1} operations exceed the limit of {MAX_STEP_OPERATIONS}" in (
        message
    )
    assert message.startswith("Step: ")  # names the call, in the API's terms
    assert pool_state(server) == before
    # At the bound the same operations run.
    step = kv.step()
    for i in range(MAX_STEP_OPERATIONS - 1):
        step.allocate(f"new{i}", [i] * 20, 20, start=True)
    step.allocate("live", [1], 1)
    results = step.send()
    assert len(results) == MAX_STEP_OPERATIONS and all(r.ok for r in results)
    assert kv.usage().num_requests == MAX_STEP_OPERATIONS


@pytest.mark.parametrize("call", ["allocate", "step", "lookup"])
def test_a_message_over_max_message_bytes_is_resource_exhausted(
    server: ServerThread, kv: KVCacheClient, call: str
) -> None:
    prompt = [7] * OVER_LIMIT
    before = pool_state(server)
    with pytest.raises(ResourceExhaustedError):
        if call == "allocate":
            kv.allocate("big", prompt, len(prompt), start=True)
        elif call == "step":
            kv.step().allocate("big", prompt, len(prompt), start=True).send()
        else:
            kv.lookup(prompt)
    assert pool_state(server) == before
    assert not server.run(lambda: server.server.pools.by_name["p"].cache.has_request("big"))


def test_a_message_just_under_max_message_bytes_is_served(
    server: ServerThread, kv: KVCacheClient
) -> None:
    prompt = [7] * UNDER_LIMIT
    result = kv.allocate("under", prompt, len(prompt), start=True)
    assert result.ok and result.num_computed_tokens == UNDER_LIMIT
    assert kv.lookup(prompt) == (UNDER_LIMIT - 1) // 16 * 16
