"""A port someone else holds: one line naming the address and the flag, exit status 1.

Each test holds a port with a listening socket first, then runs the command as a real
process (as a user would meet it), so gRPC's own bind failure and logging are in play.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from kvsvc.ports import ListenError, check_bindable
from tests.tooling import free_port

REPO = Path(__file__).resolve().parents[1]
LOOPBACK_ANY_PORTS = ("--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket is listening on."""
    with busy_ports(1) as (port,):
        yield port


@contextmanager
def busy_ports(count: int) -> Iterator[list[int]]:
    """``count`` loopback ports other sockets are listening on."""
    with ExitStack() as stack:
        holders = [stack.enter_context(socket.socket()) for _ in range(count)]
        for holder in holders:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
        yield [holder.getsockname()[1] for holder in holders]


def taken(address: str, what: str, flag: str) -> str:
    """The line a command prints for an address another process holds."""
    return (
        f"cannot listen on {address} ({what}): the address is already in use; stop what "
        f"holds it, or choose another address with {flag}"
    )


def kvsvc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


def test_serve_on_a_taken_grpc_port(busy_port: int) -> None:
    done = kvsvc(
        "serve", "--pool", "p", "--listen", f"127.0.0.1:{busy_port}", "--metrics-listen", "off"
    )
    assert one_line(done) == (
        f"kvsvc serve: cannot listen on 127.0.0.1:{busy_port} (gRPC): the address is "
        "already in use; stop what holds it, or choose another address with --listen "
        "(config key listen)"
    )
    assert done.stdout == ""  # never said it was serving


def test_serve_on_a_taken_metrics_port(busy_port: int) -> None:
    done = kvsvc(
        "serve",
        "--pool",
        "p",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        f"127.0.0.1:{busy_port}",
    )
    assert one_line(done) == (
        f"kvsvc serve: cannot listen on 127.0.0.1:{busy_port} (/metrics): the address is "
        "already in use; stop what holds it, or choose another address with --metrics-listen "
        "(config key metrics_listen)"
    )
    assert "Event loop is closed" not in done.stderr
    # docs/troubleshooting.md shows this message (wrapped), for the default port.
    page = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    shown = page.partition("already in use`\n\n```\n")[2].partition("```")[0]
    assert " ".join(shown.split()) == one_line(done).replace(str(busy_port), "9400")


def test_serve_names_every_taken_port_at_once() -> None:
    # gRPC, frames and /metrics all held: one line each, not one per attempt.
    with busy_ports(3) as (grpc_port, frames_port, metrics_port):
        done = kvsvc(
            "serve", "--pool", "p",
            "--listen", f"127.0.0.1:{grpc_port}",
            "--frames-listen", f"127.0.0.1:{frames_port}",
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
        )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "kvsvc serve: " + taken(f"127.0.0.1:{grpc_port}", "gRPC", "--listen (config key listen)"),
        "kvsvc serve: "
        + taken(f"127.0.0.1:{frames_port}", "frames", "--frames-listen (config key frames_listen)"),
        "kvsvc serve: "
        + taken(
            f"127.0.0.1:{metrics_port}", "/metrics", "--metrics-listen (config key metrics_listen)"
        ),
    ]


def test_serve_names_a_port_it_would_take_twice() -> None:
    port = free_port()
    done = kvsvc(
        "serve", "--pool", "p", "--listen", f"127.0.0.1:{port}",
        "--metrics-listen", f"0.0.0.0:{port}",
    )  # fmt: skip
    assert one_line(done) == (
        f"kvsvc serve: cannot listen on 0.0.0.0:{port} (/metrics): 127.0.0.1:{port} (gRPC) "
        "takes it already; choose another address with --metrics-listen (config key "
        "metrics_listen)"
    )


def test_serve_names_taken_kv_event_ports_with_the_others() -> None:
    pytest.importorskip("zmq")
    with busy_ports(3) as (metrics_port, pub_port, replay_port):
        done = kvsvc(
            "serve", "--pool", "p", "--listen", "127.0.0.1:0",
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--kv-events-zmq", f"tcp://*:{pub_port}",
            "--kv-events-replay", f"tcp://*:{replay_port}",
        )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines == [
        "kvsvc serve: "
        + taken(
            f"127.0.0.1:{metrics_port}", "/metrics", "--metrics-listen (config key metrics_listen)"
        ),
        "kvsvc serve: "
        + taken(
            f"tcp://*:{pub_port}",
            "KV events of pool p",
            "--kv-events-zmq (config key kv_events_zmq)",
        ),
        "kvsvc serve: "
        + taken(
            f"tcp://*:{replay_port}",
            "KV event replay of pool p",
            "--kv-events-replay (config key kv_events_replay)",
        ),
    ]


def test_indexer_on_a_taken_metrics_port(busy_port: int) -> None:
    # Checked before Redis is asked anything: no Redis server is needed to meet it.
    pytest.importorskip("redis")
    done = kvsvc(
        "indexer", "--redis", "redis://127.0.0.1:1", "--source", "127.0.0.1:1/p",
        "--metrics-listen", f"127.0.0.1:{busy_port}",
    )  # fmt: skip
    assert one_line(done) == "kvsvc indexer: " + taken(
        f"127.0.0.1:{busy_port}", "indexer /metrics", "--metrics-listen"
    )


def test_router_on_a_taken_port(busy_port: int, tmp_path: Path) -> None:
    # No "Failed to bind" from gRPC's C core, no traceback: the same line as serve's.
    pytest.importorskip("redis")
    seed = tmp_path / "seed"
    seed.write_text("a-cluster-seed-of-some-length\n")
    done = kvsvc(
        "router", "--redis", "redis://127.0.0.1:1", "--hash-seed-file", str(seed),
        "--listen", f"127.0.0.1:{busy_port}",
    )  # fmt: skip
    assert one_line(done) == "kvsvc router: " + taken(
        f"127.0.0.1:{busy_port}", "router gRPC", "--listen"
    )


def test_the_router_s_own_bind_failure_is_the_same_error(busy_port: int) -> None:
    # A port taken after the command's check: gRPC's RuntimeError becomes the ListenError.
    redis = pytest.importorskip("redis")
    from kvsvc.cluster.router import create_router
    from kvsvc.cluster.score import Scorer

    scorer = Scorer(redis.Redis(port=1, socket_connect_timeout=0.5), "seed")
    with pytest.raises(ListenError) as raised:
        create_router(scorer, f"127.0.0.1:{busy_port}")
    assert str(raised.value) == (
        f"cannot listen on 127.0.0.1:{busy_port} (router gRPC): the address cannot be bound; "
        "stop what holds it, or choose another address with --listen"
    )


def test_worker_on_a_taken_metrics_port(busy_port: int) -> None:
    pytest.importorskip("torch")
    done = kvsvc(
        "worker",
        "--server",
        "127.0.0.1:1",
        "--pool",
        "p",
        "--rank",
        "0",
        "--world-size",
        "1",
        "--device",
        "cpu",
        "--model-config",
        "llama-3.2-1b",
        "--kv-cache-memory",
        "16MiB",
        "--metrics-listen",
        f"127.0.0.1:{busy_port}",
        "--log-level",
        "WARNING",
    )
    assert one_line(done) == (
        f"kvsvc worker: error: cannot listen on 127.0.0.1:{busy_port} (agent /metrics): the "
        "address is already in use; stop what holds it, or choose another address with "
        "--metrics-listen"
    )


def test_demo_with_a_taken_metrics_port_starts_nothing(busy_port: int) -> None:
    done = kvsvc("demo", "--metrics-listen", f"127.0.0.1:{busy_port}")
    assert one_line(done) == (
        f"kvsvc demo: cannot listen on 127.0.0.1:{busy_port} (server /metrics): the address "
        "is already in use; stop what holds it, or choose another address with --metrics-listen"
    )
    assert done.stdout == ""  # failed before starting anything


def test_a_port_taken_after_the_check_is_the_same_error(
    busy_port: int, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Someone binds between the check and gRPC's bind (or the check is fooled): gRPC's
    # RuntimeError becomes the ListenError, and the half-built server is stopped on its
    # loop, so nothing complains about a closed event loop when it is collected.
    import kvsvc.server.app as app
    from kvsvc.server.config import PoolConfig, ServerConfig

    monkeypatch.setattr(app, "check_server_addresses", lambda *a, **k: None)
    for listen, metrics, what in (
        (f"127.0.0.1:{busy_port}", None, "gRPC"),
        ("127.0.0.1:0", f"127.0.0.1:{busy_port}", "/metrics"),
    ):
        config = ServerConfig(pools=(PoolConfig(name="p"),), listen=listen, metrics_listen=metrics)
        with pytest.raises(ListenError) as raised:
            asyncio.run(app.create_server(config))
        assert str(raised.value).startswith(f"cannot listen on 127.0.0.1:{busy_port} ({what})")
        gc.collect()
    assert "Event loop is closed" not in capfd.readouterr().err


def test_check_bindable_passes_free_ports_and_port_zero(busy_port: int) -> None:
    check_bindable("127.0.0.1", 0, address="127.0.0.1:0", what="x", flag="--x")
    free = free_port()
    check_bindable("127.0.0.1", free, address=f"127.0.0.1:{free}", what="x", flag="--x")
    with pytest.raises(ListenError) as raised:
        check_bindable("127.0.0.1", busy_port, address="here", what="x", flag="--x")
    assert raised.value.flag == "--x" and raised.value.address == "here"
    with pytest.raises(ListenError, match="no such address on this machine"):
        check_bindable("192.0.2.1", 5000, address="192.0.2.1:5000", what="x", flag="--x")


def test_serve_announces_itself_once() -> None:
    # One start-up line (stdout, the one tools wait for); the server's own log line of the
    # same news is DEBUG, where at INFO it printed next to it.
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", "serve", "--pool", "p", *LOOPBACK_ANY_PORTS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("kvsvc serving on port ") and ", metrics on port " in first
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (first + out + err).count("serving on port") == 1, (first, out, err)
