"""``kvsvc serve --restore FILE`` takes the pool's settings from the snapshot (issue 34).

The snapshot knows its pool: ``serve --restore FILE`` alone configures it as it was, a
flag or config key given beside it wins where it leaves the plan as it is, and one that
would make another plan is refused naming the setting, without advice about state files
that a restore has none of. A snapshot is made once per module by a real server (a pool
planned by a registered rank, written by ``ctl snapshot``'s client call).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from kvsvc_client import ClientOptions, KVCacheClient

from kvsvc.cli import build_parser
from kvsvc.commands.serve import build_config
from kvsvc.server.config import PoolConfig, ServerConfig
from kvsvc.server.persistence.records import StateError
from tests.server.harness import ServerThread, bring_up, running_server

REPO = Path(__file__).resolve().parents[2]
BYTES_PER_BLOCK = 4 * 2 * 128 * 2 * 16  # harness.llama_like_specs(): 32 KiB a block
# Settings other than the defaults, planning ones and others, so a default cannot pass.
SAVED = PoolConfig(
    name="moved",
    world_size=1,
    max_model_len=256,
    max_num_batched_tokens=1024,
    layout="block_outer",
    max_subscribers=7,
    prefix_cache_retention_interval=-1,
    max_requests=123,
)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("restore") / "moved.snapshot.db"
    with running_server(SAVED) as srv:
        ranks = bring_up(srv, pool="moved", kv_cache_bytes=40 * BYTES_PER_BLOCK)
        with KVCacheClient(srv.address, pool="moved", options=ClientOptions(timeout=10)) as kv:
            kv.snapshot(out)
        for rank in ranks:
            rank.close()
    return out


def config_of(*argv: str) -> ServerConfig:
    return build_config(build_parser().parse_args(["serve", *argv]))


def test_restore_alone_configures_the_pool_as_the_snapshot_has_it(snapshot: Path) -> None:
    config = config_of("--restore", str(snapshot))
    (pool,) = config.pools
    assert pool == SAVED  # every setting, planning or not; the seed is in the state


def test_the_flag_pool_takes_what_its_flags_leave_unset_from_the_snapshot(
    snapshot: Path,
) -> None:
    (pool,) = config_of("--pool", "moved", "--restore", str(snapshot)).pools
    assert pool == SAVED
    # A flag given wins (here one that leaves the plan as it is).
    (pool,) = config_of(
        "--pool", "moved", "--max-subscribers", "9", "--restore", str(snapshot)
    ).pools
    assert pool.max_subscribers == 9
    assert pool.max_model_len == 256 and pool.layout == "block_outer"
    # Without --restore the flags' defaults are PoolConfig's, as before.
    (plain,) = config_of("--pool", "moved").pools
    assert plain == PoolConfig(name="moved")


def test_a_config_file_pool_is_filled_in_from_the_snapshot(snapshot: Path, tmp_path: Path) -> None:
    path = tmp_path / "kvsvc.toml"
    path.write_text('[[pools]]\nname = "moved"\nmax_requests = 50\n\n[[pools]]\nname = "b"\n')
    moved, other = config_of("--config", str(path), "--restore", str(snapshot)).pools
    assert moved.max_requests == 50  # the file's key
    assert moved.max_model_len == 256 and moved.prefix_cache_retention_interval == -1
    assert other == PoolConfig(name="b")


def test_the_restored_server_serves_the_pool_started_by_the_plain_line(snapshot: Path) -> None:
    config = config_of(
        "--restore", str(snapshot), "--listen", "127.0.0.1:0", "--metrics-listen", "off"
    )
    srv = ServerThread(config, restore=[str(snapshot)])
    try:
        assert "state restored from" in srv.server.restored[0]
        assert srv.server.pools.get("moved").config == SAVED
    finally:
        srv.stop()


def test_a_flag_that_changes_the_plan_is_refused_without_state_file_advice(
    snapshot: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", "serve", "--pool", "moved", "--max-model-len", "512",
         "--restore", str(snapshot), "--listen", "127.0.0.1:0", "--metrics-listen", "off"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr == (
        f"kvsvc serve: --restore {snapshot} (pool 'moved') was planned with other settings "
        "than the config has now (max_model_len 256 -> 512): leave these settings out "
        "(kvsvc serve --restore takes the pool's settings from the snapshot) or give the "
        "snapshot's values\n"
    )
    assert done.stdout == ""


def test_a_state_directory_refusal_names_the_files_to_move(tmp_path: Path) -> None:
    pool = PoolConfig(name="p", world_size=1, max_model_len=256)
    config = ServerConfig(
        pools=(pool,), listen="127.0.0.1:0", metrics_listen=None, state_dir=str(tmp_path)
    )
    with running_server(pool, state_dir=str(tmp_path)) as srv:
        bring_up(srv, kv_cache_bytes=40 * BYTES_PER_BLOCK)[0].close()
    other = PoolConfig(name="p", world_size=1, max_model_len=128)
    with pytest.raises(StateError) as refused:
        ServerThread(dataclasses.replace(config, pools=(other,)))
    message = str(refused.value)
    assert "max_model_len 256 -> 128" in message
    assert f"move {tmp_path / 'p.db'} (and p.snapshot-*.db beside it)" in message


def test_a_snapshot_of_an_older_kvsvc_gives_its_planning_settings(
    snapshot: Path, tmp_path: Path
) -> None:
    # Written before snapshots carried every setting: only the planning ones are known.
    old = tmp_path / "old.snapshot.db"
    old.write_bytes(snapshot.read_bytes())
    with sqlite3.connect(old) as conn:
        (text,) = conn.execute("SELECT value FROM meta WHERE key = 'identity'").fetchone()
        identity = json.loads(text)
        del identity["pool_config"]
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'identity'",
            (json.dumps(identity, sort_keys=True),),
        )
    (pool,) = config_of("--restore", str(old)).pools
    assert (pool.max_model_len, pool.layout, pool.max_num_batched_tokens) == (
        256,
        "block_outer",
        1024,
    )
    assert pool.max_subscribers == PoolConfig(name="x").max_subscribers


def test_an_unreadable_restore_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(StateError, match=r"^--restore .*nope\.db: state file .* does not exist"):
        config_of("--restore", str(tmp_path / "nope.db"))
