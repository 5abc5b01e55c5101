"""An engine that schedules ahead or speculates, over real gRPC and the typed client.

The Step fields such an engine sends (``cache`` operations, ``num_in_flight_tokens``,
a start's ``num_draft_tokens`` and ``max_cache_hit_tokens``, the hashing context's
``lora_id``) reach the pool, are refused with the operation named when they are
inconsistent, and change nothing then; the KV event stream carries ``lora_id``.
The semantics themselves are ``tests/core/test_core_async_and_drafts.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvsvc_client import (
    AllocateStatus,
    BlockStored,
    HashingContext,
    KVCacheClient,
    OperationError,
    RequestStart,
)

from kvsvc.server.config import PoolConfig
from tests.server.harness import ServerThread, bring_up, llama_like_specs, running_server

pytestmark = pytest.mark.e2e

BLOCK = 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(PoolConfig(name="p", world_size=1, max_model_len=1024)) as thread:
        bring_up(thread, specs=llama_like_specs(block_size=BLOCK), kv_cache_bytes=8 << 20)
        yield thread


def test_outputs_arriving_late_are_cached_below_the_tokens_in_flight(
    server: ServerThread,
) -> None:
    prompt = list(range(100, 100 + BLOCK + BLOCK - 1))  # one block and one token short
    with KVCacheClient(server.address, pool="p") as kv:
        assert kv.allocate("a", prompt, len(prompt), start=True).status is AllocateStatus.OK
        step = kv.step()
        step.allocate("a", [], 1)  # scheduled before the last output arrived
        step.cache("a", [7], num_in_flight_tokens=1)  # it arrives; one token still in flight
        results = step.send()
        assert [r.status for r in results] == [AllocateStatus.OK, AllocateStatus.OK]
        assert results[1].num_computed_tokens == 2 * BLOCK
        probe = [*prompt, 7, 1]
        assert kv.lookup(probe) == BLOCK  # the second block's last slot is in flight
        kv.step().cache("a", [8]).send()  # the step in flight completed
        assert kv.lookup(probe) == 2 * BLOCK
        kv.free("a")


def test_inconsistent_counts_are_refused_naming_the_operation(server: ServerThread) -> None:
    with KVCacheClient(server.address, pool="p") as kv:
        kv.allocate("b", list(range(1, 9)), 8, start=True)
        step = kv.step()
        step.cache("b", [9], num_in_flight_tokens=9)  # more in flight than computed
        step.allocate("b", [9], 1, num_in_flight_tokens=-1)
        step.cache("nobody", [1])
        results = step.send()
        errors = [r for r in results if isinstance(r, OperationError)]
        assert len(errors) == 3, results
        assert "num_in_flight_tokens" in errors[0].message
        assert "num_in_flight_tokens" in errors[1].message
        assert "not live" in errors[2].message
        table = kv.block_table("b")
        assert (table.num_tokens, table.num_computed_tokens) == (8, 8)  # nothing changed
        kv.free("b")


def test_an_admission_with_drafts_and_a_capped_hit(server: ServerThread) -> None:
    prompt = list(range(500, 500 + 3 * BLOCK + 1))
    with KVCacheClient(server.address, pool="p") as kv:
        kv.allocate("c", prompt, len(prompt), start=True)
        kv.free("c")
        padded = kv.allocate("d", prompt, 4, start=RequestStart(num_draft_tokens=3))
        assert (padded.num_cached_tokens, padded.num_scheduled_tokens) == (3 * BLOCK, 4)
        kv.free("d")
        capped = kv.allocate(
            "e", prompt, len(prompt), start=RequestStart(max_cache_hit_tokens=BLOCK + 5)
        )
        assert capped.num_cached_tokens == BLOCK
        kv.free("e")


def test_the_adapters_id_reaches_watch_events(server: ServerThread) -> None:
    lora = HashingContext(lora_name="adapter", lora_path="/adapters/a", lora_id=3)
    with KVCacheClient(server.address, pool="p") as kv:
        first = kv.usage().num_blocks  # just a call: the stream starts after it
        assert first
        kv.allocate("f", list(range(9000, 9000 + BLOCK)), BLOCK, start=RequestStart(hashing=lora))
        for batch in kv.watch_events(from_sequence=1):
            stored = [e for e in batch.events if isinstance(e, BlockStored)]
            if any(e.lora_name == "adapter" for e in stored):
                assert all(e.lora_id == 3 for e in stored if e.lora_name == "adapter")
                break
        kv.free("f")
