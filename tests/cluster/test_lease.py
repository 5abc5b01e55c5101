"""A source's lease under load: its writer keeps it while its work blocks for longer than
the lease's TTL, and takes it again cleanly when it lapsed all the same. A real
redis-server, a real kvsvc server (in process) and real indexers (in process, each with
its own owner token, as two indexer processes would have).

The writer's thread used to renew the lease between two runs of batches, so a snapshot
download or a run that took longer than the TTL (a loaded machine, a slow Redis Cluster)
let it lapse under a live writer: its work was refused and thrown away, and a standby
indexer took the source over meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.cluster.indexer import Indexer
from kvsvc.cluster.layout import Keys
from kvsvc.cluster.score import Scorer
from kvsvc.cluster.source import IndexerOptions
from kvsvc.cluster.store import SourceStore, connect
from kvsvc.server.config import PoolConfig
from tests.cluster.redis_procs import RedisServer, require_redis_package
from tests.server.harness import ServerThread, bring_up, running_server
from tests.tooling import wait_for

require_redis_package()

SEED = "lease-test-seed"
POOL = PoolConfig(name="p", world_size=1, max_model_len=256, hash_seed=SEED)
KV_BYTES = 41 * 4 * 2 * 128 * 2 * 16  # 40 usable blocks of the harness specs
PROMPT = list(range(1000, 1000 + 3 * 16 + 1))  # three full blocks of the harness' 16
TTL_S = 1.5


@pytest.fixture()
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture()
def server() -> Iterator[ServerThread]:
    with running_server(POOL) as srv:
        ranks = bring_up(srv, kv_cache_bytes=KV_BYTES)
        yield srv
        for rank in ranks:
            rank.close()


def lease_holder(client: object, source: str) -> bytes | None:
    return client.get(Keys().source(source, "lease"))  # type: ignore[attr-defined,no-any-return]


def test_renewing_extends_only_the_holders_lease(redis: RedisServer) -> None:
    client = connect(redis.url)
    keys = Keys()
    lease = keys.source("h:1/p", "lease")
    holder = SourceStore(client, "h:1/p", "a", keys, lease_ttl_s=10)
    other = SourceStore(client, "h:1/p", "b", keys, lease_ttl_s=10)
    assert holder.acquire() == "new"
    client.pexpire(lease, 1000)  # most of its TTL gone
    assert holder.renew()
    assert client.pttl(lease) > 5000
    client.pexpire(lease, 1000)
    assert holder.acquire() == "ok"  # taking a lease one holds renews it too
    assert client.pttl(lease) > 5000
    client.pexpire(lease, 1000)
    assert not other.renew()  # not its lease: untouched
    assert client.get(lease) == b"a" and client.pttl(lease) <= 1000
    holder.release()
    assert not holder.renew()  # a renewal never takes a lease
    assert client.get(lease) is None


def test_a_writer_blocked_past_the_ttl_keeps_its_lease(
    redis: RedisServer, server: ServerThread
) -> None:
    """The writer's first snapshot blocks (the test holds the pool's lock, which
    SnapshotIndex takes) for three TTLs while a second indexer stands by: the lease stays
    the writer's, the rival never writes, and the snapshot is installed once."""
    client = connect(redis.url)
    source = f"{server.address}/p"
    options = IndexerOptions(lease_ttl_s=TTL_S)
    with KVCacheClient(server.address, pool="p") as kv:
        assert kv.allocate("r", PROMPT, len(PROMPT), start=True).ok
    holder, rival = Indexer(client, options), Indexer(client, options)
    lock = server.server.pools.get("p").lock
    server.call(lock.acquire())
    try:
        holder.set_sources([source])
        (writer,) = holder.followers.values()
        wait_for(lambda: writer.state_name == "writing", what="the holder to take the lease")
        rival.set_sources([source])
        (standby,) = rival.followers.values()
        wait_for(lambda: standby.state_name == "standby", what="the rival to stand by")
        time.sleep(3 * TTL_S)  # the holder's writer stays blocked in its snapshot
        assert lease_holder(client, source) == holder.owner.encode()
    finally:
        server.run(lock.release)
    try:
        assert writer.caught_up.wait(30)
        assert standby.state_name == "standby"
        assert lease_holder(client, source) == holder.owner.encode()
        assert writer.metrics.snapshots.labels("new")._value.get() == 1
        assert writer.metrics.lease_lapses._value.get() == 0
        scores = Scorer(client, SEED).score(PROMPT, max_registry_age=0).scores
        assert scores == {source: 48}
    finally:
        rival.stop()
        holder.stop()


def test_a_lease_that_lapsed_all_the_same_is_taken_again_and_the_source_followed_on(
    redis: RedisServer, server: ServerThread
) -> None:
    """The lease key goes (it lapsed while the indexer was paused, or Redis lost it): the
    keeper sees it at its next renewal, the writer takes the lease again between two runs,
    finds the index where it left it, and follows on without a snapshot."""
    client = connect(redis.url)
    source = f"{server.address}/p"
    indexer = Indexer(client, IndexerOptions(lease_ttl_s=TTL_S))
    scorer = Scorer(client, SEED)
    try:
        indexer.set_sources([source])
        (writer,) = indexer.followers.values()
        assert writer.caught_up.wait(30)
        lease = Keys().source(source, "lease")
        client.delete(lease)
        wait_for(lambda: writer.metrics.lease_lapses._value.get() == 1, 10, "the lapse")
        wait_for(lambda: lease_holder(client, source) == indexer.owner.encode(), what="retake")
        with KVCacheClient(server.address, pool="p") as kv:
            assert kv.allocate("r", PROMPT, len(PROMPT), start=True).ok
        wait_for(
            lambda: scorer.score(PROMPT, max_registry_age=0).scores == {source: 48},
            what="the new blocks to be indexed",
        )
        assert writer.state_name == "writing"
        assert writer.metrics.snapshots.labels("new")._value.get() == 1
        assert writer.metrics.snapshots.labels("resync")._value.get() == 0
        assert writer.metrics.lease_lapses._value.get() == 1
    finally:
        indexer.stop()


def test_after_redis_lost_everything_the_lease_is_taken_again_and_kept_through_the_rebuild(
    redis: RedisServer, server: ServerThread
) -> None:
    """Redis restarted empty under a following indexer: its keeper finds the lease gone,
    the writer takes it again, sees the index gone and rebuilds it from a snapshot; that
    snapshot blocks for three TTLs (the test holds the pool's lock) and the lease taken
    again is kept through it: one lapse, one resync, nothing thrown away."""
    client = connect(redis.url)
    source = f"{server.address}/p"
    indexer = Indexer(client, IndexerOptions(lease_ttl_s=TTL_S))
    try:
        with KVCacheClient(server.address, pool="p") as kv:
            assert kv.allocate("r", PROMPT, len(PROMPT), start=True).ok
        indexer.set_sources([source])
        (writer,) = indexer.followers.values()
        assert writer.caught_up.wait(30)
        lock = server.server.pools.get("p").lock
        server.call(lock.acquire())
        try:
            client.flushall()
            wait_for(lambda: writer.metrics.lease_lapses._value.get() == 1, 10, "the lapse")
            time.sleep(3 * TTL_S)  # the writer's resync stays blocked in its snapshot
        finally:
            server.run(lock.release)
        scorer = Scorer(client, SEED)
        wait_for(
            lambda: scorer.score(PROMPT, max_registry_age=0).scores == {source: 48},
            what="the index to be rebuilt",
        )
        assert lease_holder(client, source) == indexer.owner.encode()
        assert writer.metrics.lease_lapses._value.get() == 1
        assert writer.metrics.snapshots.labels("resync")._value.get() == 1
        assert writer.metrics.snapshots.labels("new")._value.get() == 1  # the first one
    finally:
        indexer.stop()
