"""SnapshotIndex: the pool's cached hashes and the event sequence they are current at,
checked against the pool's own event stream replayed from the start."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from kvsvc_client import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheClient

from kvsvc.core.seed import seed_fingerprint
from kvsvc.server.config import PoolConfig
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import bring_up, running_server

SEED = "cluster-test-seed"
POOL = PoolConfig(name="p", world_size=1, max_model_len=256, hash_seed=SEED)
KV_BYTES = 41 * 4 * 2 * 128 * 2 * 16  # 40 usable blocks of the harness specs


def snapshot(address: str, limit: int = 0) -> list[kvcache_pb2.SnapshotIndexResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        request = kvcache_pb2.SnapshotIndexRequest(pool="p", max_hashes_per_message=limit)
        return list(stub.SnapshotIndex(request, timeout=10))


def replayed_index(kv: KVCacheClient, last: int) -> Counter[tuple[int, bytes]]:
    """(group, hash) -> blocks cached under it, from every batch 1..last."""
    index: Counter[tuple[int, bytes]] = Counter()
    for batch in kv.watch_events(from_sequence=1):
        for event in batch.events:
            if isinstance(event, BlockStored):
                index.update((event.group_index, h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                index.subtract((event.group_index, h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.clear()
        if batch.sequence == last:
            break
    return +index


def snapshot_index(messages: list[kvcache_pb2.SnapshotIndexResponse]) -> Counter[tuple[int, bytes]]:
    index: Counter[tuple[int, bytes]] = Counter()
    for message in messages:
        assert len(message.block_hashes) == len(message.block_counts)
        for h, count in zip(message.block_hashes, message.block_counts, strict=True):
            assert (message.group_index, h) not in index, "a hash is sent once"
            index[(message.group_index, h)] = count
    return index


def test_the_snapshot_is_the_index_after_its_sequence() -> None:
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            empty = snapshot(server.address)
            assert len(empty) == 1 and empty[0].last and empty[0].sequence == 0
            assert empty[0].hash_seed_fingerprint == seed_fingerprint(SEED)
            assert empty[0].hash_algo == "xxh3_128" and empty[0].hash_block_size == 16
            assert [(g.group_index, g.group_kind, g.block_size) for g in empty[0].groups] == [
                (0, "full_attention", 16)
            ]
            # "b" shares "a"'s prefix, others fill the pool until cached blocks are
            # evicted for reuse.
            prompt = [*range(48), 7]
            kv.allocate("a", prompt, 49, start=True)
            kv.allocate("b", prompt, 49, start=True)
            kv.free("a", "b")
            for i in range(12):
                kv.allocate(f"r{i}", [1000 + 100 * i + t for t in range(49)], 49, start=True)
                kv.free(f"r{i}")
            messages = snapshot(server.address, limit=5)
            header = messages[0]
            assert header.sequence == 13 and header.epoch == kv.epoch
            assert messages[-1].last and not any(m.last for m in messages[:-1])
            assert all(len(m.block_hashes) <= 5 for m in messages)
            got = snapshot_index(messages)
            assert header.total_hashes == len(got)
            assert got == replayed_index(kv, header.sequence)
            assert sum(got.values()) == kv.usage().num_cached_blocks
        for rank in ranks:
            rank.close()


def test_a_duplicate_block_is_counted_until_each_copy_leaves() -> None:
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with KVCacheClient(server.address, pool="p") as kv:
            prompt = [*range(16), 1]
            kv.allocate("a", prompt, 8, start=True)  # a chunk: its block is not full yet
            kv.allocate("b", prompt, 17, start=True)  # no hit: "b" caches the block
            kv.allocate("a", [], 9)  # "a" fills its own copy of the same block
            before = snapshot_index(snapshot(server.address))
            assert list(before.values()) == [2]
            kv.free("a")
            for i, length in enumerate((255, 255, 95)):  # 16 + 16 + 6: every free block
                kv.allocate(
                    f"c{i}", [5000 + 300 * i + t for t in range(length)], length, start=True
                )
            # So "a"'s copy was reused and left the index; "b"'s (held) stays.
            messages = snapshot(server.address)
            after = snapshot_index(messages)
            assert [after[key] for key in before] == [1]
            assert snapshot_index(messages) == replayed_index(kv, messages[0].sequence)
        for rank in ranks:
            rank.close()


@pytest.mark.parametrize("limit", [-1, 65537])
def test_a_bad_message_size_is_refused_naming_the_field(limit: int) -> None:
    with running_server(POOL) as server:
        ranks = bring_up(server, "p", kv_cache_bytes=KV_BYTES)
        with pytest.raises(grpc.RpcError) as err:
            snapshot(server.address, limit=limit)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_hashes_per_message" in (err.value.details() or "")
        for rank in ranks:
            rank.close()
