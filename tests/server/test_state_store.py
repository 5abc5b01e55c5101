"""The state files themselves (issue 10): what is refused, what is migrated, and how
commits are grouped.

A state that cannot be used stops the start with a message that says which file and why
(``StateError``; ``kvsvc serve`` exits 1): a newer schema, a damaged file or row, a file
of another pool or lineage, a journal whose replay does not give the acknowledged
replies. Nothing of such a state is served: the pool is only taken over once all of it
loaded and replayed. An older schema is migrated in place.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvsvc_client import KVCacheClient, UnavailableError

from kvsvc.server.config import PoolConfig, ServerConfig
from kvsvc.server.persistence.journal_store import PoolStore
from kvsvc.server.persistence.records import JournalRecord, StateError
from kvsvc.server.persistence.schema import SCHEMA_VERSION, create_journal_schema_v1
from kvsvc.server.persistence.snapshot_file import read_snapshot
from kvsvc.server.persistence.wal import wal_damage
from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc
from tests.server.harness import ServerThread, bring_up
from tests.server.test_restart import MEMORY, POOL, QUICK, core_state, crash, server_on


def make_state(state_dir: Path, calls: int = 12) -> dict[str, Any]:
    """A pool with live requests and a journal (no snapshot since its planning); returns
    its core state as the crash left it."""
    with server_on(state_dir) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            for i in range(calls):
                assert kv.allocate(f"r{i}", [1] * 20 + [i] * 10, 30, start=True).ok
            kv.free("r0", preempted=True)
            step = kv.step()
            for i in range(1, calls):
                step.allocate(f"r{i}", [7], 1)
            step.send()
            state = core_state(srv)
        ranks[0].close()
        crash(srv)
    return state


def start(state_dir: Path, pool: PoolConfig = POOL) -> ServerThread:
    config = ServerConfig(
        pools=(pool,), listen="127.0.0.1:0", metrics_listen=None, state_dir=str(state_dir)
    )
    return ServerThread(config)


def journal_db(state_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(state_dir / "p.db", isolation_level=None)


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    make_state(tmp_path)
    with journal_db(tmp_path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StateError, match=rf"schema version {SCHEMA_VERSION + 1}, newer"):
        start(tmp_path)
    # The same through `kvsvc serve`: exit status 1 and the message, nothing served.
    served = subprocess.run(
        [sys.executable, "-m", "kvsvc", "serve", "--pool", "p", "--max-model-len", "256",
         "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--state-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert served.returncode == 1
    assert "newer than this kvsvc" in served.stderr and "serving" not in served.stdout


def test_an_older_schema_is_migrated(tmp_path: Path) -> None:
    """A version-1 journal (rows without checksums) is upgraded in place on open and its
    rows replay as before."""
    state = make_state(tmp_path)
    with journal_db(tmp_path) as conn:
        meta = conn.execute("SELECT key, value FROM meta").fetchall()
        ranks = conn.execute("SELECT * FROM ranks").fetchall()
        rows = conn.execute(
            "SELECT seq, kind, engine, payload, event_seq, event_ts, reply_digest FROM journal"
        ).fetchall()
    assert rows
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"p.db{suffix}").unlink(missing_ok=True)
    with sqlite3.connect(tmp_path / "p.db", isolation_level=None) as old:
        old.execute("PRAGMA application_id = 1263948630")
        create_journal_schema_v1(old)
        old.executemany("INSERT INTO meta VALUES (?, ?)", meta)
        old.executemany("INSERT INTO ranks VALUES (?, ?, ?)", ranks)
        old.executemany("INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
        old.execute("PRAGMA user_version = 1")
    srv = start(tmp_path)
    try:
        assert core_state(srv) == state
        assert f"{len(rows)} journal rows replayed" in srv.server.restored[0]
    finally:
        srv.stop()
    with journal_db(tmp_path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_kvsvc_serve_says_once_that_it_restored_a_pool(tmp_path: Path) -> None:
    """The restore line went to the log and to stdout, so a terminal showed it twice."""
    from kvsvc.demo.processes import spawn, wait_for_ports

    make_state(tmp_path)
    serve = spawn(
        "serve",
        ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p",
         "--world-size", "1", "--max-model-len", "256", "--state-dir", str(tmp_path)],
    )  # fmt: skip
    try:
        wait_for_ports(serve)
    finally:
        assert serve.stop() == 0, serve.output()
    said = [line for line in serve.lines if "state restored" in line]
    assert len(said) == 1, serve.output()
    assert "pool p: state restored" in said[0] and "journal rows replayed" in said[0]


def test_a_damaged_snapshot_is_refused(tmp_path: Path) -> None:
    make_state(tmp_path)
    (snapshot,) = tmp_path.glob("p.snapshot-*.db")
    with sqlite3.connect(snapshot, isolation_level=None) as conn:
        data = bytearray(conn.execute("SELECT data FROM chunks WHERE n = 0").fetchone()[0])
        data[len(data) // 2] ^= 0xFF
        conn.execute("UPDATE chunks SET data = ? WHERE n = 0", (bytes(data),))
    with pytest.raises(StateError, match="does not match its checksum"):
        start(tmp_path)


def test_a_file_that_is_no_state_is_refused(tmp_path: Path) -> None:
    make_state(tmp_path)
    (tmp_path / "p.db").write_bytes(b"this is not SQLite at all " * 100)
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"p.db{suffix}").unlink(missing_ok=True)
    with pytest.raises(StateError, match="not a kvsvc state file or is damaged"):
        start(tmp_path)
    (tmp_path / "p.db").unlink()
    with sqlite3.connect(tmp_path / "p.db") as foreign:
        foreign.execute("CREATE TABLE t (x)")
    with pytest.raises(StateError, match=r"not a kvsvc state file \(SQLite application id"):
        start(tmp_path)


def test_a_damaged_journal_row_is_refused(tmp_path: Path) -> None:
    make_state(tmp_path)
    with journal_db(tmp_path) as conn:
        seq = conn.execute("SELECT MAX(seq) FROM journal").fetchone()[0]
        conn.execute("UPDATE journal SET payload = payload || x'00' WHERE seq = ?", (seq,))
    with pytest.raises(StateError, match=f"journal row {seq} is damaged"):
        start(tmp_path)


def test_a_replay_that_gives_other_replies_is_refused(tmp_path: Path) -> None:
    """A row whose reply does not replay (another kvsvc's semantics, a tampered row with a
    valid checksum): refused, not served as another state."""
    make_state(tmp_path)
    with journal_db(tmp_path) as conn:
        row = conn.execute(
            "SELECT seq, kind, engine, payload, event_seq, event_ts, reply_digest FROM journal "
            "ORDER BY seq LIMIT 1"
        ).fetchone()
        forged = JournalRecord(*row[:6], row[6] ^ 1)
        conn.execute(
            "UPDATE journal SET reply_digest = ?, checksum = ? WHERE seq = ?",
            (forged.reply_digest, forged.checksum(), forged.seq),
        )
    with pytest.raises(StateError, match="replays to another reply than the one acknowledged"):
        start(tmp_path)


def test_another_pools_or_lineages_files_are_refused(tmp_path: Path) -> None:
    make_state(tmp_path / "one")
    make_state(tmp_path / "two")
    # Pool p's files under the name of pool q.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for path in (tmp_path / "one").iterdir():
        shutil.copy(path, renamed / path.name.replace("p.", "q.", 1))
    with pytest.raises(StateError, match="holds the state of pool 'p', not 'q'"):
        start(renamed, PoolConfig(name="q", world_size=1, max_model_len=256))
    # The snapshot of another state of the same pool next to this journal.
    (snapshot,) = (tmp_path / "two").glob("p.snapshot-*.db")
    shutil.copy(snapshot, tmp_path / "one" / snapshot.name)
    with pytest.raises(StateError, match="belongs to another state of pool 'p'"):
        start(tmp_path / "one")


def test_a_failed_commit_acknowledges_nothing(tmp_path: Path) -> None:
    """When the disk refuses a commit, the call that waited for it fails (UNAVAILABLE),
    and so does every later change: the restart has exactly what was acknowledged."""
    with server_on(tmp_path) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("kept", [1] * 30, 30, start=True).ok
            acknowledged = core_state(srv)
            store = srv.run(lambda: srv.server.pools.get("p").persistence.store)

            def refuse(*args: Any) -> None:
                raise sqlite3.OperationalError("disk I/O error")

            store.commit = refuse
            with pytest.raises(UnavailableError, match="writing its state"):
                kv.allocate("lost", [2] * 30, 30, start=True)
            with pytest.raises(UnavailableError, match="acknowledges no more changes"):
                kv.free("kept")
            assert kv.lookup([1] * 30) == 16  # reads go on
        ranks[0].close()
        crash(srv)
    with server_on(tmp_path) as srv:
        assert core_state(srv) == acknowledged


def test_calls_that_arrive_together_share_a_commit(tmp_path: Path) -> None:
    """A call recorded while a commit is under way waits for the next one, which takes
    everything recorded meanwhile. The commit is made slow (50 ms, in ``full`` mode's
    thread) so that 40 calls sent at once meet a commit in progress however fast or
    slow this machine is; in ``normal`` mode the grouping is per turn of the event loop,
    which depends on how the calls' bytes arrive."""
    with server_on(tmp_path, state_synchronous="full") as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        store = srv.run(lambda: srv.server.pools.get("p").persistence.store)
        commit = store.commit

        def slow_commit(*args: Any) -> Any:
            time.sleep(0.05)
            return commit(*args)

        store.commit = slow_commit

        async def burst() -> None:
            async with grpc.aio.insecure_channel(srv.address) as channel:
                stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
                requests = [
                    kvcache_pb2.AllocateRequest(
                        pool="p", request_id=f"r{i}", new_token_ids=[i + 1] * 8, num_new_tokens=8
                    )
                    for i in range(40)
                ]
                for request in requests:
                    request.start.SetInParent()
                await asyncio.gather(*(stub.Allocate(r, timeout=10) for r in requests))

        persistence = srv.run(lambda: srv.server.pools.get("p").persistence)
        commits_before = persistence.num_commits
        asyncio.run(burst())
        commits = persistence.num_commits - commits_before
        assert persistence.num_records >= 40
        assert commits <= 20  # grouped: two or three here, one per 50 ms at the most
        ranks[0].close()


def test_a_new_store_is_private(tmp_path: Path) -> None:
    make_state(tmp_path / "s")
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    for path in (tmp_path / "s").iterdir():
        assert path.stat().st_mode & 0o077 == 0, path  # the hash seed is a secret
    assert PoolStore.open(tmp_path / "s", "absent") is None


def burst_of_admissions(address: str, count: int, tokens: int) -> list[Any]:
    """``count`` admissions sent at once (they share commits); returns each one's outcome
    (its reply, or the RPC error it got)."""

    async def burst() -> list[Any]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
            requests = [
                kvcache_pb2.AllocateRequest(
                    pool="p", request_id=f"b{i}", new_token_ids=[i + 9] * tokens, num_new_tokens=1
                )
                for i in range(count)
            ]
            for request in requests:
                request.start.SetInParent()
            return await asyncio.gather(
                *(stub.Allocate(r, timeout=10) for r in requests), return_exceptions=True
            )

    return asyncio.run(burst())


def test_a_full_disk_is_reported_as_a_full_disk(tmp_path: Path) -> None:
    """SQLite rolls a transaction back itself when the disk fills; the ROLLBACK that
    followed then failed ("cannot rollback - no transaction is active") and that was what
    the server reported. The database is capped at its size now (SQLite's own
    ``max_page_count``, which fails writes exactly as a full disk does) and a burst of
    admissions (nothing scheduled: many rows, no blocks) shares commits of several rows."""
    pool = replace(POOL, max_unscheduled_tokens=1 << 20)
    with server_on(tmp_path, pool, state_synchronous="full") as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        store = srv.run(lambda: srv.server.pools.get("p").persistence.store)
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        store._conn.execute(f"PRAGMA max_page_count = {pages}")
        outcomes = burst_of_admissions(srv.address, 40, 200)
        errors = {o.details() for o in outcomes if isinstance(o, grpc.aio.AioRpcError)}
        assert errors, "no commit failed: the cap did not bite"
        failure = srv.run(lambda: srv.server.pools.get("p").persistence.failed)
        assert f"the disk of state_dir {tmp_path} is full" in failure
        assert "free space on the disk and restart it" in failure
        assert "rollback" not in failure
        assert errors == {failure}
        ranks[0].close()


def test_a_truncated_wal_restores_under_a_new_epoch(tmp_path: Path) -> None:
    """A WAL cut short (a power loss in ``normal`` mode, a damaged disk) gives back an
    earlier state: its event sequence numbers after that point were handed out already,
    so the pool serves it under a new epoch (kept by the next restart), and a restart
    that lost nothing keeps the epoch."""
    state = tmp_path / "state"
    with server_on(state, state_checkpoint_interval_s=3600) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            for i in range(6):
                assert kv.allocate(f"r{i}", [i + 1] * 40, 40, start=True).ok
            epoch = kv.epoch
            last_sequence = srv.run(lambda: srv.server.pools.get("p").events.last_sequence)
        ranks[0].close()
        # Another reader keeps the WAL as a kill would (the last connection to close
        # checkpoints it into the database and deletes it).
        with journal_db(state) as reader:
            reader.execute("SELECT COUNT(*) FROM journal").fetchone()
            crash(srv)
            intact = shutil.copytree(state, tmp_path / "intact")
            cut = shutil.copytree(state, tmp_path / "cut")
    with server_on(intact) as srv:  # nothing lost: the same epoch
        assert srv.run(lambda: srv.server.pools.get("p").events.last_sequence) == last_sequence
        assert srv.run(lambda: srv.server.pools.get("p").events.epoch) == epoch
    wal = cut / "p.db-wal"
    # The page size from the database header (opening it would recover the WAL first).
    page_size = int.from_bytes((cut / "p.db").read_bytes()[16:18], "big")
    with wal.open("r+b") as f:  # drop the last frame: the last commit goes with it
        f.truncate(wal.stat().st_size - (24 + page_size))
    with server_on(cut) as srv:
        events = srv.run(lambda: srv.server.pools.get("p").events)
        assert events.last_sequence < last_sequence
        renewed = events.epoch
        assert renewed != epoch
    with server_on(cut) as srv:  # the new epoch is the state's now
        assert srv.run(lambda: srv.server.pools.get("p").events.epoch) == renewed


def cut_state(tmp_path: Path) -> tuple[Path, str, int]:
    """A state whose WAL lost its last frame (the last commit), as a power loss leaves
    it; returns its directory, the epoch and the event sequence acknowledged before."""
    state = tmp_path / "state"
    with server_on(state, state_checkpoint_interval_s=3600) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            for i in range(6):
                assert kv.allocate(f"r{i}", [i + 1] * 40, 40, start=True).ok
            epoch = kv.epoch
            last_sequence = srv.run(lambda: srv.server.pools.get("p").events.last_sequence)
        ranks[0].close()
        with journal_db(state) as reader:  # keeps the WAL, as a kill would
            reader.execute("SELECT COUNT(*) FROM journal").fetchone()
            crash(srv)
            cut = shutil.copytree(state, tmp_path / "cut")
    page_size = int.from_bytes((cut / "p.db").read_bytes()[16:18], "big")
    wal = cut / "p.db-wal"
    with wal.open("r+b") as f:
        f.truncate(wal.stat().st_size - (24 + page_size))
    return cut, epoch, last_sequence


@pytest.mark.parametrize(
    "damage, said",
    [
        ("missing", "p.acked is missing"),
        ("garbage", "p.acked is damaged"),
        ("binary", "p.acked is damaged (not text)"),
        ("other-lineage", "p.acked is another state's"),
    ],
)
def test_a_cut_wal_without_a_sound_acked_marker_gets_a_new_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, said: str
) -> None:
    """Regression (issue 32 item 10): with the marker gone or garbage, a cut WAL's earlier
    state was served under the epoch subscribers had read further in. A marker that
    shows nothing now means a new epoch, with a warning that names the file."""
    cut, epoch, last_sequence = cut_state(tmp_path)
    marker = cut / "p.acked"
    if damage == "missing":
        marker.unlink()
    elif damage == "garbage":
        marker.write_text("not a position at all\n")
    elif damage == "binary":
        marker.write_bytes(b"\xff\xfe\x00garbage")
    else:
        marker.write_text(f"{'0' * 32} {10**6:020d}\n")
    with caplog.at_level("WARNING", logger="kvsvc.server"), server_on(cut) as srv:
        events = srv.run(lambda: srv.server.pools.get("p").events)
        assert events.last_sequence < last_sequence
        renewed = events.epoch
        assert renewed != epoch
    warned = [r.getMessage() for r in caplog.records if "new event epoch" in r.getMessage()]
    assert len(warned) == 1 and said in warned[0], warned
    with server_on(cut) as srv:  # the marker is sound again: the epoch stays
        assert srv.run(lambda: srv.server.pools.get("p").events.epoch) == renewed


def _flipped(state: Path, frame: int, to: Path) -> Path:
    """A copy of ``state`` with one byte of WAL frame ``frame``'s page flipped (its
    index file dropped: the first connection then rebuilds it, checking each frame)."""
    copy = shutil.copytree(state, to)
    (copy / "p.db-shm").unlink(missing_ok=True)
    wal = copy / "p.db-wal"
    page_size = int.from_bytes(wal.read_bytes()[8:12], "big")
    data = bytearray(wal.read_bytes())
    data[32 + frame * (24 + page_size) + 24 + page_size // 2] ^= 0x01
    wal.write_bytes(bytes(data))
    return copy


def _pointer(state: Path) -> int:
    """The snapshot generation the journal points at, as SQLite reads it."""
    with journal_db(state) as conn:
        return int(
            conn.execute("SELECT value FROM meta WHERE key = 'snapshot_generation'").fetchone()[0]
        )


def test_a_flipped_wal_page_is_reported_as_the_fault_it_is(tmp_path: Path) -> None:
    """Regression (issue 32 item 13): a flipped bit in a WAL frame makes SQLite stop reading
    the log there, so the journal reads as an earlier state pointing at a snapshot that a
    later one replaced; the start said only "snapshot-2.db does not exist". It now names
    the damaged frame, the snapshot that replaced the one pointed at, and the ways on."""
    state = tmp_path / "state"
    with server_on(state, state_snapshot_every=10**9, state_checkpoint_interval_s=3600) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        writer = srv.run(lambda: srv.server.pools.get("p").persistence)
        # A reader that keeps every commit from here on in the WAL (no checkpoint can
        # copy a frame past its snapshot of the file into the database).
        with journal_db(state) as reader:
            reader.execute("BEGIN")
            reader.execute("SELECT COUNT(*) FROM journal").fetchone()
            with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
                for generation in (2, 3):
                    for i in range(4):
                        assert kv.allocate(
                            f"g{generation}-{i}", [generation] * 20, 20, start=True
                        ).ok
                    assert srv.call(writer.snapshot())
                    assert writer.store.snapshot_generation == generation
                assert kv.allocate("after", [9] * 20, 20, start=True).ok
            ranks[0].close()
            crash(srv)
            pristine = shutil.copytree(state, tmp_path / "pristine")
            reader.execute("ROLLBACK")
    assert sorted(p.name for p in pristine.glob("p.snapshot-*.db")) == ["p.snapshot-3.db"]
    # A frame whose loss leaves the journal pointing at snapshot 2: after the commit
    # that pointed at it, before the one that pointed at 3.
    frames = ((pristine / "p.db-wal").stat().st_size - 32) // (
        24 + int.from_bytes((pristine / "p.db-wal").read_bytes()[8:12], "big")
    )
    frame = next(
        k for k in range(frames) if _pointer(_flipped(pristine, k, tmp_path / f"probe-{k}")) == 2
    )
    with pytest.raises(StateError) as refused:
        start(_flipped(pristine, frame, tmp_path / "start"))
    message = str(refused.value)
    assert "points at snapshot p.snapshot-2.db, which is not there" in message
    assert "p.snapshot-3.db replaced it later" in message
    assert f"p.db-wal is damaged: frame {frame + 1} of {frames}" in message
    assert "--restore" in message
    assert "does not exist" not in message
    # What is not damage: a torn last frame (never committed), no log at all.
    assert wal_damage(_flipped(pristine, frames - 1, tmp_path / "torn") / "p.db") is None
    assert wal_damage(tmp_path / "nowhere" / "p.db") is None
    header = shutil.copytree(pristine, tmp_path / "header")
    data = bytearray((header / "p.db-wal").read_bytes())
    data[20] ^= 0x01  # a salt: the header's checksum breaks
    (header / "p.db-wal").write_bytes(bytes(data))
    assert "header fails its checksum" in (wal_damage(header / "p.db") or "")


def test_snapshots_without_their_journal_are_not_dropped_silently(tmp_path: Path) -> None:
    state = tmp_path / "state"
    make_state(state)
    for journal in state.glob("p.db*"):
        journal.unlink()
    with pytest.raises(StateError, match=r"pool 'p' has no journal \(p.db\) but its snapshot"):
        start(state)
    # The way on it names: the snapshot moved out and restored, under a new epoch (the
    # calls journaled after it were acknowledged in the old one).
    (snapshot,) = state.glob("p.snapshot-*.db")
    moved = shutil.move(snapshot, tmp_path / "moved.db")
    with server_on(state, restore=[str(moved)]) as srv:
        epoch = srv.run(lambda: srv.server.pools.get("p").events.epoch)
        assert epoch != read_snapshot(moved).identity["epoch"]


def stopped_cleanly(state: Path) -> tuple[str, int]:
    """A pool with three live requests, stopped cleanly (its final snapshot holds every
    acknowledged call); returns its event epoch and last sequence."""
    with server_on(state) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            for i in range(3):
                assert kv.allocate(f"r{i}", [1] * 20 + [i] * 10, 30, start=True).ok
            epoch = kv.epoch
            last_sequence = srv.run(lambda: srv.server.pools.get("p").events.last_sequence)
        ranks[0].close()
    assert epoch is not None
    return epoch, last_sequence


def test_restoring_an_up_to_date_snapshot_keeps_the_epoch(tmp_path: Path) -> None:
    """The same way on, with the snapshot a clean stop wrote: it holds every call the
    directory acknowledged, so no sequence number of its epoch was handed out past it.
    A new epoch would make every subscriber and indexer resync for nothing."""
    state = tmp_path / "state"
    epoch, last_sequence = stopped_cleanly(state)
    (snapshot,) = state.glob("p.snapshot-*.db")  # the final one, of the clean stop
    assert read_snapshot(snapshot).identity["epoch"] == epoch
    for journal in state.glob("p.db*"):
        journal.unlink()
    moved = shutil.move(snapshot, tmp_path / "moved.db")
    with server_on(state, restore=[str(moved)]) as srv:
        events = srv.run(lambda: srv.server.pools.get("p").events)
        assert (events.epoch, events.last_sequence) == (epoch, last_sequence)


def test_restore_files_must_each_be_a_configured_pool_once(tmp_path: Path) -> None:
    stopped_cleanly(tmp_path / "state")
    (snapshot,) = (tmp_path / "state").glob("p.snapshot-*.db")
    first, second = (
        shutil.copy(snapshot, tmp_path / "a.db"),
        shutil.copy(snapshot, tmp_path / "b.db"),
    )
    with pytest.raises(StateError, match=r"--restore .*b\.db and .*a\.db are both pool 'p'"):
        ServerThread(
            ServerConfig(pools=(POOL,), listen="127.0.0.1:0", metrics_listen=None),
            restore=[str(first), str(second)],
        )
    other = replace(POOL, name="q")
    with pytest.raises(StateError, match=r"holds pool 'p', which is not configured \(pools: q\)"):
        ServerThread(
            ServerConfig(pools=(other,), listen="127.0.0.1:0", metrics_listen=None),
            restore=[str(first)],
        )


def test_a_crashs_leftover_files_are_removed_at_start(tmp_path: Path) -> None:
    """Snapshots of other generations and half-written files a crash left behind go when
    the state is loaded; the current snapshot stays."""
    state = tmp_path / "state"
    make_state(state)
    (current,) = state.glob("p.snapshot-*.db")
    leftovers = [state / "p.snapshot-999.db", state / "p.snapshot-999.db-wal", state / "p.db.tmp7"]
    for path in leftovers:
        path.write_bytes(b"half written")
    srv = start(state)
    try:
        assert [p for p in leftovers if p.exists()] == []
        assert list(state.glob("p.snapshot-*.db")) == [current]
    finally:
        srv.stop()


def unshare_works() -> bool:
    """Whether this machine lets a process mount a tmpfs in its own namespace."""
    try:
        return (
            subprocess.run(
                ["unshare", "--map-root-user", "--mount", "true"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.e2e
@pytest.mark.skipif(not unshare_works(), reason="needs unshare (user and mount namespaces)")
def test_a_really_full_disk_says_so_while_serving_and_after_a_restart(tmp_path: Path) -> None:
    """A real filesystem that fills up (a 3 MiB tmpfs, in a namespace of its own): the
    change that meets the full disk, and the first change after a restart on it, answer
    UNAVAILABLE saying the disk is full."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {mountpoint} && "
        f"exec {sys.executable} -m tests.server.disk_full_scenario {mountpoint}"
    )
    result = subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    full = f"the disk of state_dir {mountpoint / 'state'} is full"
    for when in ("running", "restart"):
        assert outcome[when].startswith("UNAVAILABLE") and full in outcome[when], outcome
        assert "free space on the disk" in outcome[when]
