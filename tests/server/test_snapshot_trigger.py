"""When a snapshot replaces the journal (issue 32, item 5).

Each journal row counted one unit of replay work (~3 us) while replaying it costs tens to
hundreds of microseconds: after 150 s of single-call Allocate/Free traffic no snapshot had
been taken, and a restart replayed 81,000 rows in 22 s (clients give up after 30). Rows
now weigh what they cost (a fixed part per row, then operations and tokens), a snapshot
that is overdue (twice ``state_snapshot_every``) is taken even before
``state_snapshot_min_interval_s``, and a restart counts the journal it replayed by the same
weights. benchmarks/state_bench.py measures the replay time this leaves after load.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvsvc_client import KVCacheClient

from kvsvc.server.persistence.writer import (
    ROW_REPLAY_UNITS,
    SNAPSHOT_OVERDUE_FACTOR,
    replay_units,
)
from tests.server.harness import bring_up
from tests.server.test_restart import MEMORY, QUICK, crash, server_on

EVERY = 50 * ROW_REPLAY_UNITS


def persistence(srv):  # type: ignore[no-untyped-def]
    return srv.run(lambda: srv.server.pools.get("p").persistence)


def wait_for_snapshots(srv, count: int) -> int:  # type: ignore[no-untyped-def]
    """The snapshots taken, once ``count`` are or a generous deadline passed (a snapshot
    is written in a thread)."""
    deadline = time.monotonic() + 30
    writer = persistence(srv)
    while (writer.num_snapshots < count or writer.snapshotting) and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(writer.num_snapshots)


def test_single_call_rows_weigh_what_replaying_them_costs(tmp_path: Path) -> None:
    """Regression: 1 unit per Allocate or Free row. With a long minimum interval, the
    journal is left alone until it is overdue, then replaced at once."""
    settings = {"state_snapshot_every": EVERY, "state_snapshot_min_interval_s": 3600.0}
    with server_on(tmp_path, **settings) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        writer = persistence(srv)
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            # Each admission and free: a row of its own, 10+ units, not 1.
            for i in range(30):
                assert kv.allocate(f"r{i}", [i + 1] * 8, 8, start=True).ok
                kv.free(f"r{i}")
            work = srv.run(lambda: writer.work_since_snapshot)
            assert work >= 60 * ROW_REPLAY_UNITS > EVERY  # due, but the interval holds it
            assert writer.num_snapshots == 0
            for i in range(30, 60):
                assert kv.allocate(f"r{i}", [i + 1] * 8, 8, start=True).ok
                kv.free(f"r{i}")
            # Past SNAPSHOT_OVERDUE_FACTOR x EVERY: taken whatever the interval says.
            assert SNAPSHOT_OVERDUE_FACTOR * EVERY <= 120 * ROW_REPLAY_UNITS
            assert wait_for_snapshots(srv, 1) >= 1
        ranks[0].close()


def test_a_restart_weighs_the_journal_it_replayed(tmp_path: Path) -> None:
    """The restarted writer counts the rows it found by their weights (it counted one
    snapshot's worth, whatever they held)."""
    settings = {"state_snapshot_every": 10**9}
    with server_on(tmp_path, **settings) as srv:
        ranks = bring_up(srv, kv_cache_bytes=MEMORY, allocation_id="A")
        with KVCacheClient(srv.address, pool="p", options=QUICK) as kv:
            assert kv.allocate("a", [1] * 40, 40, start=True).ok
            step = kv.step()
            step.allocate("a", [2], 1)
            step.allocate("b", [3] * 20, 20, start=True)
            step.send()
            kv.free("a", "b")
        served = persistence(srv).work_since_snapshot
        ranks[0].close()
        crash(srv)
    expected = replay_units(1, 40) + replay_units(2, 21) + replay_units(2, 0)
    assert served == expected
    with server_on(tmp_path, **settings) as srv:
        assert persistence(srv).work_since_snapshot == expected
