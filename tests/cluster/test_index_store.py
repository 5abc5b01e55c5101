"""The index's Redis side against real redis-servers (one, and a 3-node Redis Cluster):
applying event runs, the sequence guard, the lease, pending bits after a crash, snapshots,
purges, and Score over what was written."""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvsvc.cluster.hashing import PromptHasher
from kvsvc.cluster.layout import APPLY, Keys
from kvsvc.cluster.score import Scorer
from kvsvc.cluster.store import (
    STAGE_TTL_MS,
    InvalidSource,
    LeaseLost,
    SourceMoved,
    SourceStore,
    Tracking,
    connect,
)
from tests.cluster.redis_procs import redis_deployment, require_redis_package

require_redis_package()

SEED = "store-test-seed"
HASHER = PromptHasher("xxh3_128", SEED)
TRACKING = Tracking((0,), 16, 16, "xxh3_128", HASHER.fingerprint)
_prefixes = itertools.count()


@pytest.fixture(scope="module", params=["single", "cluster"])
def redis_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with redis_deployment(tmp_path_factory.mktemp(f"redis-{request.param}"), request.param) as url:
        yield url


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t{next(_prefixes)}")  # every test its own index


def prompt(n_blocks: int, base: int = 0) -> list[int]:
    return [base + t for t in range(16 * n_blocks + 1)]


def stored(tokens: list[int], first: int = 0, last: int | None = None) -> list[bytes]:
    hashes = HASHER.block_hashes(tokens, 16, 16)
    return [b"S\0" + h for h in hashes[first:last]]


def removed(tokens: list[int], first: int, last: int | None = None) -> list[bytes]:
    return [b"R\0" + h for h in HASHER.block_hashes(tokens, 16, 16)[first:last]]


def new_source(client: object, name: str, keys: Keys, owner: str = "a") -> SourceStore:
    store = SourceStore(client, name, owner, keys, lease_ttl_s=5)
    assert store.acquire() == "new"
    store.install("e1", 0, TRACKING, {})
    return store


def test_scores_are_the_longest_run_of_leading_blocks_per_engine(
    redis_url: str, keys: Keys
) -> None:
    client = connect(redis_url)
    a = new_source(client, "10.0.0.1:1/p", keys)
    b = new_source(client, "10.0.0.2:1/p", keys)
    tokens = prompt(6)
    a.apply("e1", 1, 1, TRACKING, stored(tokens))  # all 6 blocks
    b.apply("e1", 1, 2, TRACKING, stored(tokens, 0, 4) + removed(tokens, 1, 2))  # 0, 2, 3
    scorer = Scorer(client, SEED, keys)
    assert scorer.score(tokens, max_registry_age=0).scores == {
        "10.0.0.1:1/p": 96,
        "10.0.0.2:1/p": 16,
    }
    # At least one token is left to compute: a prompt of exactly 6 blocks hits 5.
    assert scorer.score(tokens[:-1]).scores["10.0.0.1:1/p"] == 80
    assert scorer.score(tokens, engines={"10.0.0.2:1/p", "nobody"}).scores == {"10.0.0.2:1/p": 16}
    # Another salt hashes to other blocks: nothing cached.
    from kvsvc.core.hashing import HashingContext

    salted = scorer.score(tokens, HashingContext(cache_salt="x")).scores
    assert set(salted.values()) == {0}


def test_a_block_cached_twice_stays_until_both_copies_leave(redis_url: str, keys: Keys) -> None:
    client = connect(redis_url)
    a = new_source(client, "h:1/p", keys)
    tokens = prompt(2)
    a.apply("e1", 1, 2, TRACKING, stored(tokens) + stored(tokens, 0, 1))
    scorer = Scorer(client, SEED, keys)
    a.apply("e1", 3, 3, TRACKING, removed(tokens, 0, 1))
    assert scorer.score(tokens, max_registry_age=0).scores == {"h:1/p": 32}
    a.apply("e1", 4, 4, TRACKING, removed(tokens, 0, 1))
    assert scorer.score(tokens).scores == {"h:1/p": 0}
    # The block's last bit took its key with it: no all-zero bitmap stays behind.
    first = HASHER.block_hashes(tokens, 16, 16)[0]
    assert not client.exists(keys.block(first))
    a.apply("e1", 5, 5, TRACKING, [*stored(tokens, 0, 1), b"C"])
    assert a.counts() == {}
    assert scorer.score(tokens).scores == {"h:1/p": 0}


def test_batches_apply_once_in_order_of_their_epoch(redis_url: str, keys: Keys) -> None:
    client = connect(redis_url)
    a = new_source(client, "h:1/p", keys)
    tokens = prompt(2)
    a.apply("e1", 1, 1, TRACKING, stored(tokens))
    assert a.apply("e1", 1, 1, TRACKING, stored(tokens)).duplicate
    assert a.counts() == {op[1:]: 1 for op in stored(tokens)}
    with pytest.raises(SourceMoved, match="gap"):
        a.apply("e1", 3, 3, TRACKING, removed(tokens, 0))
    with pytest.raises(SourceMoved, match="epoch"):
        a.apply("e2", 2, 2, TRACKING, removed(tokens, 0))
    assert a.state().seq == 1


def test_only_the_lease_holder_writes(redis_url: str, keys: Keys) -> None:
    client = connect(redis_url)
    a = new_source(client, "h:1/p", keys, owner="a")
    b = SourceStore(client, "h:1/p", "b", keys, lease_ttl_s=5)
    assert b.acquire() == "held"
    b.release()  # not its lease to give back: nothing happens
    assert b.acquire() == "held"
    with pytest.raises(LeaseLost):
        b.apply("e1", 1, 1, TRACKING, stored(prompt(1)))
    assert a.acquire() == "ok"
    a.release()
    assert b.acquire() == "new"
    with pytest.raises(LeaseLost):
        a.apply("e1", 1, 1, TRACKING, stored(prompt(1)))
    assert b.apply("e1", 1, 1, TRACKING, stored(prompt(1))).flips == 1


def test_bits_a_crashed_writer_decided_are_written_by_the_next(redis_url: str, keys: Keys) -> None:
    client = connect(redis_url)
    a = new_source(client, "h:1/p", keys, owner="a")
    tokens = prompt(3)
    # The script's step alone, as if the writer died before setting the bits.
    script = client.register_script(APPLY)
    reply = script(
        keys=keys.source_keys("h:1/p"),
        # One class: the primary one (bitmap prefix, pending form "h", group 0).
        args=["a", "e1", 1, 1, -1, 1, keys.block(b""), "h", 1, b"\0", *stored(tokens)],
    )
    assert reply[0] == b"ok" and len(reply) == 2 + 2 * 3
    scorer = Scorer(client, SEED, keys)
    assert scorer.score(tokens, max_registry_age=0).scores == {"h:1/p": 0}
    a.release()
    b = SourceStore(client, "h:1/p", "b", keys)
    assert b.acquire() == "new"
    assert b.flush_pending() == 3
    assert scorer.score(tokens).scores == {"h:1/p": 48}
    assert b.flush_pending() == 0


def test_a_snapshot_replaces_the_index_and_a_purge_drops_the_engine(
    redis_url: str, keys: Keys
) -> None:
    client = connect(redis_url)
    a = new_source(client, "h:1/p", keys)
    old, new = prompt(3, base=0), prompt(2, base=5000)
    a.apply("e1", 1, 1, TRACKING, stored(old))
    counts = {op[1:]: 1 for op in stored(new)}
    a.install("e2", 7, TRACKING, counts)
    assert a.state().epoch == "e2" and a.state().seq == 7
    # The staged snapshot's TTL (its leftovers expire) does not come along into the index.
    assert client.pttl(keys.source("h:1/p", "blocks")) == -1
    scorer = Scorer(client, SEED, keys)
    assert scorer.score(old, max_registry_age=0).scores == {"h:1/p": 0}
    assert scorer.score(new).scores == {"h:1/p": 32}
    assert a.purge() == 2
    assert scorer.score(new, max_registry_age=0).scores == {}
    assert a.state().epoch is None and a.counts() == {}
    # Its engine id stays its own: indexed again, it gets the same bit.
    engine = a.engine_id
    a.install("e3", 0, TRACKING, {})
    assert a.engine_id == engine == int(client.hget(keys.ids, "h:1/p"))


def test_a_scorer_with_another_seed_scores_nothing_and_says_so(
    redis_url: str, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect(redis_url)
    a = new_source(client, "h:1/p", keys)
    a.apply("e1", 1, 1, TRACKING, stored(prompt(2)))
    with caplog.at_level(logging.WARNING, "kvsvc.cluster"):
        result = Scorer(client, "another-seed", keys).score(prompt(2))
    assert result.scores == {"h:1/p": 0} and result.seed_mismatch == ("h:1/p",)
    said = "1 engine hashes with another seed than this scorer (e.g. h:1/p): scored 0"
    assert [r.getMessage() for r in caplog.records] == [said]
    b = new_source(client, "h:2/p", keys)
    b.apply("e1", 1, 1, TRACKING, stored(prompt(2)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvsvc.cluster"):
        Scorer(client, "another-seed", keys).score(prompt(2))
    (message,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(
        r"2 engines hash with another seed than this scorer \(e\.g\. h:[12]/p\): scored 0",
        message,
    )


def test_tracking_leaves_out_a_window_it_is_not_told() -> None:
    """Groups without their window (a server older than IndexGroup.sliding_window) are
    not tracked: the full-attention groups are, as before."""
    tracking = Tracking.from_groups(
        [(0, "sliding_window", 16), (1, "full_attention", 32), (2, "full_attention", 32)],
        16,
        "xxh3_128",
        "",
    )
    assert tracking.groups == (1, 2) and tracking.block_size == 32
    assert tracking.classes == () and tracking.untracked == (0,)


def test_a_bad_redis_url_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--redis"):
        connect("localhost:6379")


def test_runs_are_compacted_per_hash_between_clears() -> None:
    from kvsvc.cluster.store import compact_ops

    a, b = b"\0" + b"a" * 16, b"\0" + b"b" * 16
    ops = [b"S" + a, b"S" + b, b"R" + a, b"S" + b, b"C", b"S" + a, b"R" + b, b"R" + b]
    assert compact_ops(ops) == [b"D" + b, b"2", b"C", b"S" + a, b"D" + b, b"-2"]


def test_a_hybrid_engine_needs_the_hash_in_every_tracked_group(redis_url: str, keys: Keys) -> None:
    client = connect(redis_url)
    both = Tracking((0, 1), 16, 16, "xxh3_128", HASHER.fingerprint)
    a = SourceStore(client, "h:1/p", "a", keys)
    assert a.acquire() == "new"
    a.install("e1", 0, both, {})
    tokens = prompt(2)
    in_group = [[op[:1] + bytes([g]) + op[2:] for op in stored(tokens)] for g in (0, 1)]
    scorer = Scorer(client, SEED, keys)
    a.apply("e1", 1, 1, both, in_group[0])
    assert scorer.score(tokens, max_registry_age=0).scores == {"h:1/p": 0}
    a.apply("e1", 2, 2, both, in_group[1][:1])  # the first block in both groups
    assert scorer.score(tokens).scores == {"h:1/p": 16}
    a.apply("e1", 3, 3, both, in_group[1][1:])
    assert scorer.score(tokens).scores == {"h:1/p": 32}
    a.apply("e1", 4, 4, both, [b"R" + in_group[0][0][1:]])  # block 0 left group 0
    assert scorer.score(tokens).scores == {"h:1/p": 0}


def test_every_group_index_of_a_byte_is_indexed(redis_url: str, keys: Keys) -> None:
    """Group indexes are one byte in the keys: 255 is indexed and scored, 256 refused
    (the source is quarantined, naming it) with nothing written."""
    client = connect(redis_url)
    last = Tracking((255,), 16, 16, "xxh3_128", HASHER.fingerprint)
    a = SourceStore(client, "h:1/p", "a", keys)
    assert a.acquire() == "new"
    tokens = prompt(2)
    a.install("e1", 0, last, {b"\xff" + h: 1 for h in HASHER.block_hashes(tokens, 16, 16)})
    assert Scorer(client, SEED, keys).score(tokens, max_registry_age=0).scores == {"h:1/p": 32}
    b = SourceStore(client, "h:2/p", "b", keys)
    assert b.acquire() == "new"
    past = Tracking((256,), 16, 16, "xxh3_128", HASHER.fingerprint)
    with pytest.raises(InvalidSource, match=r"group index 256 \(must be in \[0, 255\]\)"):
        b.install("e1", 0, past, {})
    assert b.state().epoch is None


def test_after_redis_lost_everything_the_sources_get_ids_anew(redis_url: str, keys: Keys) -> None:
    """Redis restarted empty: the id registry is gone too. Each source takes its lease
    afresh and reinstalls; the ids it remembered must not be reused, or a source indexed
    first after the loss gets an id another still writes under (both scores wrong)."""
    client = connect(redis_url)
    a = new_source(client, "a:1/p", keys)
    b = new_source(client, "b:1/p", keys)
    prompt_a, prompt_b = prompt(3, base=0), prompt(2, base=7000)
    a.apply("e1", 1, 1, TRACKING, stored(prompt_a))
    b.apply("e1", 1, 1, TRACKING, stored(prompt_b))
    assert (a.engine_id, b.engine_id) == (0, 1)
    client.flushall()
    # B's source is taken over by another indexer (its standby), which knows no id and
    # is the first after the loss: B gets id 0, the one A remembered. Then A.
    b = SourceStore(client, "b:1/p", "standby", keys, lease_ttl_s=5)
    assert b.acquire() == "new"
    b.install("e1", 1, TRACKING, {op[1:]: 1 for op in stored(prompt_b)})
    assert b.engine_id == 0
    assert a.acquire() == "new"
    a.install("e1", 1, TRACKING, {op[1:]: 1 for op in stored(prompt_a)})
    assert a.engine_id == 1
    scorer = Scorer(client, SEED, keys)
    assert scorer.score(prompt_a, max_registry_age=0).scores == {"a:1/p": 48, "b:1/p": 0}
    assert scorer.score(prompt_b, max_registry_age=0).scores == {"a:1/p": 0, "b:1/p": 32}


def block_keys(keys: Keys, *prompts: list[int]) -> list[bytes]:
    """The bitmap keys of every block of ``prompts``."""
    return [keys.block(h) for p in prompts for h in HASHER.block_hashes(p, 16, 16)]


def test_a_purge_leaves_no_block_bits_behind(redis_url: str, keys: Keys) -> None:
    """The purged engine's bit is cleared in every bitmap it was set in (a bitmap left
    with no bit is deleted), its pending bits are gone, and another engine's bits in the
    same bitmaps stay."""
    client = connect(redis_url)
    a = new_source(client, "a:1/p", keys)
    b = new_source(client, "b:1/p", keys)
    own, shared, other = prompt(3, base=100), prompt(2, base=200), prompt(2, base=300)
    a.apply("e1", 1, 1, TRACKING, stored(own) + stored(shared))
    b.apply("e1", 1, 1, TRACKING, stored(shared) + stored(other))
    assert a.purge() == 5
    assert a.engine_id is not None and b.engine_id is not None
    for key in block_keys(keys, own, shared, other):
        assert client.getbit(key, a.engine_id) == 0, key
    assert not any(client.exists(key) for key in block_keys(keys, own))
    assert all(client.getbit(key, b.engine_id) for key in block_keys(keys, shared, other))
    source = keys.source_keys("a:1/p")
    assert not client.exists(source[2]) and not client.exists(source[5])  # no pending left
    assert a.counts() == {}


def stall_past_the_lease(
    monkeypatch: pytest.MonkeyPatch, store: SourceStore, takeover: Callable[[], None]
) -> None:
    """``store`` stalls past its lease in the middle of its next install or purge (after
    its first flush, when it reads the counts it is about to replace): the lease runs out
    and ``takeover`` (another indexer taking the source) runs meanwhile."""
    real = store.counts

    def stalled() -> dict[bytes, int]:
        monkeypatch.setattr(store, "counts", real)
        store.client.delete(store.keys.source(store.name, "lease"))  # it ran out
        takeover()
        return real()

    monkeypatch.setattr(store, "counts", stalled)


@pytest.mark.parametrize("write", ["install", "purge"])
def test_a_writer_that_lost_its_lease_leaves_the_holder_alone(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """An indexer stalled in a resync (or a purge) past its lease while another took the
    source over and installed its snapshot: when it wakes up its write raises LeaseLost
    and the holder's meta, counts, registry entry and scores are as the holder left
    them. Before the write starts it raises at once too."""
    client = connect(redis_url)
    name = "h:1/p"
    old, stale, fresh = prompt(3, base=0), prompt(2, base=5000), prompt(2, base=9000)
    a = new_source(client, name, keys, owner="a")
    a.apply("e1", 1, 1, TRACKING, stored(old))
    b = SourceStore(client, name, "b", keys, lease_ttl_s=5)
    fresh_counts = {op[1:]: 1 for op in stored(fresh)}

    def takeover() -> None:
        assert b.acquire() == "new"
        b.install("e2", 4, TRACKING, fresh_counts)

    def holder_state() -> tuple[object, ...]:
        scorer = Scorer(client, SEED, keys)
        scores = [scorer.score(p, max_registry_age=0).scores for p in (old, stale, fresh)]
        return b.state(), b.counts(), client.hget(keys.sources, name), scores

    def write_as_a() -> None:
        if write == "install":
            a.install("e1", 9, TRACKING, {op[1:]: 1 for op in stored(stale)})
        else:
            a.purge()

    stall_past_the_lease(monkeypatch, a, takeover)
    with pytest.raises(LeaseLost):
        write_as_a()
    held = holder_state()
    assert held[0].epoch == "e2" and held[0].seq == 4 and held[1] == fresh_counts
    assert held[2] is not None
    assert held[3] == [{name: 0}, {name: 0}, {name: 32}]
    with pytest.raises(LeaseLost):
        write_as_a()  # the lease long gone: refused before anything is written
    assert holder_state() == held


def test_a_stalled_writer_cannot_touch_the_holders_snapshot_being_staged(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Indexer A stalls in the middle of an install, past its lease; B takes the source
    over and, while B is staging its snapshot, A wakes up and stages its own before its
    install script finds the lease gone. B's snapshot must be installed as B wrote it:
    each writer stages under keys of its own."""
    client = connect(redis_url)
    name = "h:1/p"
    stale, fresh = prompt(2, base=5000), prompt(2, base=9000)
    fresh_counts = {op[1:]: 1 for op in stored(fresh)}
    a = new_source(client, name, keys, owner="a")
    b = SourceStore(client, name, "b", keys, lease_ttl_s=5)
    a_stalled, a_wakes = threading.Event(), threading.Event()
    reading = a.counts

    def stall() -> dict[bytes, int]:
        a_stalled.set()
        assert a_wakes.wait(30)
        return reading()

    monkeypatch.setattr(a, "counts", stall)
    outcome: list[str] = []

    def install_as_a() -> None:
        try:
            a.install("e1", 9, TRACKING, {op[1:]: 1 for op in stored(stale)})
            outcome.append("installed")
        except LeaseLost:
            outcome.append("lease lost")

    writer = threading.Thread(target=install_as_a, daemon=True)
    writer.start()
    assert a_stalled.wait(30)
    client.delete(keys.source(name, "lease"))  # A's lease ran out
    assert b.acquire() == "new"
    staging = b._pending_entry

    def a_wakes_mid_staging(key: bytes, bit: int) -> tuple[bytes, str]:
        monkeypatch.setattr(b, "_pending_entry", staging)
        a_wakes.set()
        writer.join(30)
        return staging(key, bit)

    monkeypatch.setattr(b, "_pending_entry", a_wakes_mid_staging)
    b.install("e2", 4, TRACKING, fresh_counts)
    assert outcome == ["lease lost"]
    assert b.state().epoch == "e2" and b.counts() == fresh_counts
    scorer = Scorer(client, SEED, keys)
    assert scorer.score(fresh, max_registry_age=0).scores == {name: 32}
    assert scorer.score(stale).scores == {name: 0}
    # What A staged stays out of the index and expires by itself.
    for key in keys.source_keys(name, "a")[4:]:
        assert 0 < client.pttl(key) <= STAGE_TTL_MS, key
