"""The framed transport in real processes: ``kvsvc serve --frames-listen`` with a real
``kvsvc worker --device cpu``, the serve command's lines and flag errors, and a SIGKILL
restart on a state directory that the same frames client rides through."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvsvc_client import ClientOptions, KVCacheClient

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from tests.frames.helpers import TINY_SPECS, short_dir
from tests.tooling import free_port

pytest.importorskip("torch")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

POOL = "fp"
PATIENT = ClientOptions(timeout=5, backoff=0.02, max_backoff=0.3, unavailable_timeout=60)


def serve(sock: str, *extra: str, port: int = 0) -> Child:
    return spawn(
        "server",
        [
            "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off",
            "--pool", POOL, "--max-model-len", "512", "--heartbeat-timeout", "3",
            "--frames-listen", sock, "--log-level", "WARNING", *extra,
        ],
    )  # fmt: skip


def worker(port: int, spec_file: Path) -> Child:
    return spawn(
        "worker",
        [
            "worker", "--server", f"127.0.0.1:{port}", "--pool", POOL, "--rank", "0",
            "--world-size", "1", "--device", "cpu", "--spec-file", str(spec_file),
            "--kv-cache-memory", "1MiB", "--heartbeat-interval", "0.3",
        ],
    )  # fmt: skip


@pytest.fixture()
def tmp() -> Iterator[Path]:
    with short_dir() as path:
        (path / "specs.json").write_text(json.dumps(TINY_SPECS))
        yield path


def frames_lines(server: Child) -> list[str]:
    lines = list(server.lines)
    serving = next(i for i, line in enumerate(lines) if line.startswith("kvsvc serving on"))
    return [line for line in lines[:serving] if line.startswith("kvsvc frames on")]


def test_engine_calls_over_frames_to_a_real_server_and_worker(tmp: Path) -> None:
    """A real server with a Unix and a TCP frames listener (announced before the serving
    line), its pool made READY by a real CPU worker: the engine calls over both, seen the
    same over gRPC, with the epoch gRPC sees."""
    sock = f"unix:{tmp}/f.sock"
    children = [serve(sock, "--frames-listen", "127.0.0.1:0")]
    try:
        port, _ = wait_for_ports(children[0], timeout=60)
        announced = frames_lines(children[0])
        assert announced[0] == f"kvsvc frames on {sock}"
        assert len(announced) == 2 and announced[1].startswith("kvsvc frames on 127.0.0.1:")
        tcp = announced[1].removeprefix("kvsvc frames on ")
        assert not tcp.endswith(":0")
        children.append(worker(port, tmp / "specs.json"))
        with (
            KVCacheClient(f"frames:{sock}", pool=POOL, options=PATIENT) as kv,
            KVCacheClient(f"frames:{tcp}", pool=POOL, options=PATIENT) as kv_tcp,
            KVCacheClient(f"127.0.0.1:{port}", pool=POOL, options=PATIENT) as over_grpc,
        ):
            assert kv.wait_until_ready(timeout=60).state == "READY"
            assert [p.name for p in kv_tcp.list_pools()] == [POOL]
            prompt = list(range(1, 40))
            assert kv.allocate("a", prompt, 39, start=True).ok
            step = kv_tcp.step()
            step.allocate("a", [40], 1)
            step.allocate("b", prompt, 39, start=True)
            grown, admitted = step.send()
            assert grown.ok and admitted.ok and admitted.num_cached_tokens == 32
            assert kv.lookup(prompt) == 32
            assert kv.block_table("a") == kv_tcp.block_table("a") == over_grpc.block_table("a")
            assert over_grpc.allocate("b", [40], 1).ok
            assert kv_tcp.block_table("b").num_tokens == 40
            assert kv.usage() == over_grpc.usage()
            assert kv.usage().num_requests == 2
            assert kv.epoch is not None and kv.epoch == kv_tcp.epoch == over_grpc.epoch
            assert kv.reset_prefix_cache() is False
            assert kv.free("a", "b") > 0
            assert kv_tcp.reset_prefix_cache() is True
            assert over_grpc.usage().num_requests == 0
    finally:
        stop_all(children)


def test_the_same_frames_client_rides_through_a_sigkill_restart(tmp: Path) -> None:
    """A request admitted over frames; the server is SIGKILLed and started again on the
    same state directory, socket and port (the worker reconnects by itself): the next
    allocate on the same client succeeds through its UNAVAILABLE retries, on the block
    table acknowledged before, under the same epoch."""
    sock = f"unix:{tmp}/r.sock"
    state = ("--state-dir", str(tmp / "state"))
    server = serve(sock, *state)
    children = [server]
    try:
        port, _ = wait_for_ports(server, timeout=60)
        children.append(worker(port, tmp / "specs.json"))
        with KVCacheClient(f"frames:{sock}", pool=POOL, options=PATIENT) as kv:
            kv.wait_until_ready(timeout=60)
            assert kv.allocate("keep", list(range(1, 40)), 39, start=True).ok
            before = kv.block_table("keep")
            epoch = kv.epoch
            assert epoch is not None
            server.process.kill()  # SIGKILL: no final snapshot
            server.process.wait(10)
            server = serve(sock, *state, port=port)
            children[0] = server
            wait_for_ports(server, timeout=60)
            grown = kv.allocate("keep", [40], 1)  # retried while UNAVAILABLE
            assert grown.ok, grown
            after = kv.block_table("keep")
            assert after.groups == before.groups  # the 40th token fits the third block
            assert (before.num_tokens, after.num_tokens) == (39, 40)
            assert kv.epoch == epoch
            assert kv.free("keep") > 0
    finally:
        stop_all(children)


def run_serve(listen: str, frames_listen: str) -> subprocess.CompletedProcess[str]:
    """``kvsvc serve`` with these two addresses, expected to stop at start."""
    return subprocess.run(
        [
            sys.executable, "-m", "kvsvc", "serve", "--listen", listen,
            "--metrics-listen", "off", "--pool", POOL, "--frames-listen", frames_listen,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def test_a_frames_port_in_use_stops_serve_with_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_serve("127.0.0.1:0", f"127.0.0.1:{port}")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--frames-listen" in lines[0] and str(port) in lines[0]
    assert "kvsvc serving on" not in result.stdout


def test_a_frames_address_equal_to_the_grpc_one_stops_serve() -> None:
    port = free_port()
    result = run_serve(f"127.0.0.1:{port}", f"127.0.0.1:{port}")
    assert result.returncode == 2, result.stderr
    assert "frames_listen" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_serve_announces_a_socket_only_frames_listener_before_serving(tmp: Path) -> None:
    sock = f"unix:{tmp}/a.sock"
    server = serve(sock)
    try:
        deadline = time.monotonic() + 60
        while not any(line.startswith("kvsvc serving on") for line in server.lines):
            assert server.alive(), server.output()
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        assert frames_lines(server) == [f"kvsvc frames on {sock}"]
    finally:
        stop_all([server])
