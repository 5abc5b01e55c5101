"""``kvsvc ctl`` as an operator meets it: pools with liveness and what a pool waits for,
``wait-ready`` for scripts, ``events`` that say they wait and stop when caught up, token
hints, and ``--help`` that describes every subcommand. Each runs the real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.server.config import PoolConfig
from tests.server.harness import FakeRank, ServerThread, bring_up, llama_like_specs, running_server
from tests.tooling import free_port

REPO = Path(__file__).resolve().parents[1]
TOKEN_ENV = ("KVSVC_AUTH_TOKEN", "KVSVC_ADMIN_TOKEN", "KVSVC_AUTH_TOKEN_FILE")


def ctl(
    server: str, *args: str, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in TOKEN_ENV}
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", "ctl", "--server", server, "--timeout", "5", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**clean, **env},
    )


def test_pools_says_what_a_pool_waits_for_and_which_rank_is_gone() -> None:
    pool = PoolConfig(name="llama", world_size=2, max_model_len=1024)
    with running_server(pool, heartbeat_timeout_s=30.0) as srv:
        waiting = ctl(srv.address, "pools")
        assert waiting.returncode == 0, waiting.stderr
        header, row, hint = waiting.stdout.splitlines()
        assert header.split() == [
            "POOL", "STATE", "RANKS", "LIVE", "BLOCKS", "BLOCK", "MAXLEN", "HASH"
        ]  # fmt: skip
        # Nothing planned yet: '-', not a 0 that reads as "zero blocks, zero length".
        assert row.split() == [
            "llama",
            "WAITING_FOR_WORKERS",
            "0/2",
            "0/2",
            "-",
            "-",
            "-",
            "xxh3_128",
        ]
        assert hint.strip() == (
            "waiting for agents of rank 0, 1 (kvsvc worker --rank N); "
            f"`kvsvc ctl --server {srv.address} wait-ready llama --timeout 60` waits for READY"
        )

        ranks = bring_up(srv, pool="llama", world_size=2, kv_cache_bytes=4 << 20)
        ready = ctl(srv.address, "pools").stdout.splitlines()
        assert ready[1].split()[:4] == ["llama", "READY", "2/2", "2/2"]
        assert all(", allocated, live (heartbeat " in line for line in ready[2:4]), ready
        assert len(ready) == 4  # READY: nothing to wait for

        ranks[0].close()  # rank 0's agent goes away (its plan stream closes)
        deadline = time.monotonic() + 20
        while True:
            lines = ctl(srv.address, "pools").stdout.splitlines()
            if "DEGRADED" in lines[1] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert lines[1].split()[:4] == ["llama", "DEGRADED", "2/2", "1/2"]
        assert (
            "rank 0: cpu on test, allocated, NOT LIVE: agent disconnected (plan stream "
            in (lines[2])
        )
        assert ", live (heartbeat" in lines[3]
        assert lines[4].strip().startswith("serving, but rank 0 is not live: restart its agent")
        as_json = json.loads(ctl(srv.address, "pools", "--json").stdout)
        assert [(w["connected"], w["live"]) for w in as_json[0]["workers"]] == [
            (False, False),
            (True, True),
        ]
        ranks[1].close()


def test_a_lost_rank_of_an_engine_is_the_engine_to_restart() -> None:
    """vLLM on kvsvc: the rank's agent is the engine's own worker, so the hint names the
    engine, not a kvsvc worker to start (issue 30)."""
    with running_server(PoolConfig(name="vllm", world_size=1, max_model_len=1024)) as srv:
        rank = FakeRank(
            srv.address, "vllm", 0, 1, llama_like_specs(), 4 << 20, in_engine=True
        ).join()
        rank.close()  # the engine exits: its worker's plan stream closes
        deadline = time.monotonic() + 20
        while True:
            lines = ctl(srv.address, "pools").stdout.splitlines()
            if "DEGRADED" in lines[1] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert lines[-1].strip() == (
            "serving, but rank 0 is not live: its agent is the engine's worker (vLLM on "
            "kvsvc): restart the engine (its workers register the ranks again)"
        )
        assert json.loads(ctl(srv.address, "pools", "--json").stdout)[0]["workers"][0]["in_engine"]


def test_wait_ready_times_out_naming_the_state_then_succeeds() -> None:
    pool = PoolConfig(name="p", world_size=1, max_model_len=1024)
    with running_server(pool) as srv:
        started = time.monotonic()
        late = ctl(srv.address, "wait-ready", "p", "--timeout", "0.5")
        assert late.returncode == 1
        assert late.stderr.strip() == (
            "kvsvc ctl: pool 'p' not ready after 0.5s: WAITING_FOR_WORKERS, 0/1 ranks registered"
        )
        assert time.monotonic() - started < 30
        unknown = ctl(srv.address, "wait-ready", "nope", "--timeout", "30")
        assert unknown.returncode == 1
        assert unknown.stderr.strip() == "kvsvc ctl: the server has no pool 'nope' (its pools: p)"
        ranks = bring_up(srv, pool="p", kv_cache_bytes=4 << 20)
        ok = ctl(srv.address, "wait-ready", "p", "--timeout", "30")
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.startswith("pool 'p' is READY: 1/1 ranks, ")
        for rank in ranks:
            rank.close()


def test_wait_ready_waits_for_a_server_that_is_not_up() -> None:
    port = free_port()
    done = ctl(f"127.0.0.1:{port}", "wait-ready", "p", "--timeout", "1")
    assert done.returncode == 1
    assert "not ready after 1s: the server is unreachable (UNAVAILABLE" in done.stderr


@pytest.fixture
def pool_with_events() -> ServerThread:
    srv = ServerThread(
        __import__("kvsvc.server.config", fromlist=["ServerConfig"]).ServerConfig(
            pools=(PoolConfig(name="e", world_size=1, max_model_len=1024),),
            listen="127.0.0.1:0",
            metrics_listen=None,
        )
    )
    srv.ranks = bring_up(srv, pool="e", kv_cache_bytes=4 << 20)  # type: ignore[attr-defined]
    with KVCacheClient(srv.address, pool="e") as kv:  # two batches of events
        kv.allocate("a", [*range(32), 1], 40, start=True)
        kv.allocate("b", [*range(100, 132), 1], 40, start=True)
    yield srv
    for rank in srv.ranks:  # type: ignore[attr-defined]
        rank.close()
    srv.stop()


def test_events_count_stops_when_caught_up(pool_with_events: ServerThread) -> None:
    """The server's caught_up marker ends it: not --idle's quiet time (60 s here)."""
    started = time.monotonic()
    done = ctl(
        pool_with_events.address, "events", "e", "--from", "1", "--count", "3", "--idle", "60"
    )
    assert done.returncode == 0, done.stderr
    batches = [json.loads(line) for line in done.stdout.splitlines()]
    assert [b["sequence"] for b in batches] == [1, 2]  # the marker is not printed
    assert all(e["type"] == "BlockStored" for b in batches for e in b["events"])
    assert done.stderr.strip() == (
        "kvsvc ctl: caught up after 2 of 3 batches (the server has sent every batch it "
        "holds; --follow waits for the rest)"
    )
    assert time.monotonic() - started < 30
    two = ctl(pool_with_events.address, "events", "e", "--from", "1", "--count", "2")
    assert [json.loads(line)["sequence"] for line in two.stdout.splitlines()] == [1, 2]
    assert two.stderr == ""  # stopped at the count


def test_events_of_an_unknown_pool_says_not_found_and_nothing_about_waiting(
    pool_with_events: ServerThread,
) -> None:
    done = ctl(pool_with_events.address, "events", "nosuch")
    assert done.returncode == 1
    assert done.stderr.strip() == 'kvsvc ctl: NOT_FOUND: unknown pool "nosuch" (pools: e)'


def test_events_idle_must_be_more_than_0(pool_with_events: ServerThread) -> None:
    """--idle 0 stopped before the held batches arrived, "caught up after 0 of 1"."""
    args = ("events", "e", "--from", "1", "--count", "1", "--idle")
    done = ctl(pool_with_events.address, *args, "0")
    assert done.returncode == 2
    assert "argument --idle: expected a positive number, got '0'" in done.stderr
    done = ctl(pool_with_events.address, *args, "0.5")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["sequence"] for line in done.stdout.splitlines()] == [1]


def test_events_from_past_the_wire_width_is_a_clear_error(pool_with_events: ServerThread) -> None:
    """Regression (issue 32 item 11): --from 2^64 printed a thread's traceback (the
    number does not fit the request's uint64) and exited 0."""
    args = ("events", "e", "--count", "1", "--from")
    done = ctl(pool_with_events.address, *args, str(2**64))
    assert done.returncode == 2
    assert f"argument --from: expected an integer in [1, {2**64 - 1}], got '{2**64}'" in done.stderr
    assert "Traceback" not in done.stderr and not done.stdout
    # The largest the wire carries reaches the server, which says what it is past.
    done = ctl(pool_with_events.address, *args, str(2**64 - 1))
    assert done.returncode == 1
    assert done.stderr.startswith("kvsvc ctl: INVALID_ARGUMENT: from_sequence: ")
    assert "beyond the next sequence number" in done.stderr and "Traceback" not in done.stderr


def test_the_clients_refuse_a_sequence_the_wire_cannot_carry(
    pool_with_events: ServerThread,
) -> None:
    with (
        KVCacheClient(pool_with_events.address, pool="e") as client,
        pytest.raises(ValueError, match=r"from_sequence must be in \[0, 2\^64\)"),
    ):
        next(client.watch_events(2**64))


def test_events_follow_waits_for_the_count(pool_with_events: ServerThread) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        ctl(
            pool_with_events.address,
            "events",
            "e",
            "--from",
            "1",
            "--count",
            "3",
            "--follow",
            timeout=5,
        )


def test_events_without_from_says_it_waits(pool_with_events: ServerThread) -> None:
    import selectors

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "ctl", "--server", pool_with_events.address, "events", "e"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        line = proc.stderr.readline()
        assert line.strip() == (
            "kvsvc ctl: waiting for new events of pool 'e' (--from 1 starts with the held "
            "ones; Ctrl-C stops)"
        )
        # New batches until one shows (the stream may open after the first): never the
        # two held before it started.
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 60
        with KVCacheClient(pool_with_events.address, pool="e") as kv:
            for n in range(1000):
                kv.allocate(f"c{n}", [*range(1000 + 32 * n, 1032 + 32 * n), 1], 40, start=True)
                if selector.select(timeout=0.5) or time.monotonic() > deadline:
                    break
        assert json.loads(proc.stdout.readline())["sequence"] >= 3
    finally:
        proc.terminate()
        proc.wait(10)


def test_unauthenticated_says_how_to_pass_a_token() -> None:
    token = "0123456789abcdef-admin"
    pool = PoolConfig(name="p", world_size=1, max_model_len=1024)
    with running_server(pool, auth_token=token) as srv:
        done = ctl(srv.address, "pools")
        assert done.returncode == 1
        assert done.stderr.strip() == (
            "kvsvc ctl: UNAUTHENTICATED: missing authorization metadata (expected 'Bearer "
            "<token>'; kvsvc clients read it from --token-file or KVSVC_ADMIN_TOKEN or "
            "KVSVC_ENGINE_TOKEN)"
        )
        wrong = ctl(srv.address, "pools", KVSVC_ADMIN_TOKEN="0123456789abcdef-wrong")
        assert "unknown token in the authorization metadata (check --token-file / " in (
            wrong.stderr
        )
        assert ctl(srv.address, "pools", KVSVC_ADMIN_TOKEN=token).returncode == 0


@pytest.mark.parametrize(
    ("command", "words"),
    [
        ("pools", "liveness"),
        ("wait-ready", "Exit 1 after --timeout"),
        ("plan", "as `kvsvc plan` prints it"),
        ("usage", "hit rate"),
        ("events", "caught up"),
        ("reset-prefix-cache", "refused (exit 1)"),
    ],
)
def test_every_subcommand_help_describes_it(command: str, words: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc", "ctl", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0
    _usage, _, rest = done.stdout.partition("\n\n")
    description = rest.partition("\n\n")[0]
    assert words in " ".join(description.split()), done.stdout


def test_ctl_pools_lists_a_fake_rank_that_never_allocated() -> None:
    # Registered but not allocated yet: the pool is PLANNED and says which rank it waits on.
    pool = PoolConfig(name="p", world_size=1, max_model_len=1024)
    with running_server(pool) as srv:
        rank = FakeRank(srv.address, "p", 0, 1, llama_like_specs(), 4 << 20)
        rank.register()
        rank.open_stream()
        assert not rank.wait_for_config().error
        lines = ctl(srv.address, "pools").stdout.splitlines()
        assert lines[1].split()[:4] == ["p", "PLANNED", "1/1", "1/1"]
        assert "not allocated, live" in lines[2]
        assert (
            lines[3]
            .strip()
            .startswith("planned; waiting for rank 0 to report its allocation; `kvsvc ctl --server")
        )
        rank.close()


def test_wait_ready_stops_at_a_planning_failure_and_says_it() -> None:
    """The agents were told the plan failed (too little memory): waiting cannot fix that,
    so wait-ready prints the server's error and exits 1 at once, not at its timeout."""
    with running_server(PoolConfig(name="p", world_size=1, max_model_len=4096)) as srv:
        agent = FakeRank(srv.address, "p", 0, 1, llama_like_specs(), 10 * 32 * 1024)
        agent.register()
        agent.open_stream()
        assert agent.wait_for_config().error
        started = time.monotonic()
        done = ctl(srv.address, "wait-ready", "p", "--timeout", "60")
        assert time.monotonic() - started < 30
        assert done.returncode == 1
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("kvsvc ctl: pool 'p' failed to plan: ")
        assert "--max-model-len" in line
        agent.close()


def test_events_from_a_sequence_below_1_is_a_usage_error(pool_with_events: ServerThread) -> None:
    """Was a thread's traceback (the client's ValueError) and then a wait."""
    done = ctl(pool_with_events.address, "events", "e", "--from", "-1", timeout=30)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "argument --from: expected an integer >= 1, got '-1'" in done.stderr
