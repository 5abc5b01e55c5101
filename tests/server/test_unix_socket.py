"""``--listen unix:PATH``: a real server on a Unix-domain socket (the sidecar case).

Engine calls, a rank registering, ``kvsvc ctl`` and the health check all go over the
socket; the server may listen on TCP beside it (probes and routers). A path that cannot be
a socket, or one a live server already serves (gRPC would silently take it over), stops the
start with one line naming the flag.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.demo.processes import spawn, stop_all
from kvsvc.ports import ListenError, check_unix_bindable, unix_path
from kvsvc.server.app import pool_health_name
from kvsvc.server.config import ConfigError, PoolConfig, ServerConfig
from kvsvc.tools.healthcheck import check_grpc
from tests.server.harness import FakeRank, ServerThread, llama_like_specs

POOL = "p"
SERVE_REST = ("--pool", POOL, "--metrics-listen", "off")


def _config(listen: str) -> ServerConfig:
    return ServerConfig(
        pools=(PoolConfig(name=POOL, world_size=1, max_model_len=1024),),
        listen=listen,
        metrics_listen=None,
    )


@contextmanager
def _serving(listen: str) -> Iterator[ServerThread]:
    thread = ServerThread(_config(listen))
    try:
        yield thread
    finally:
        thread.stop()


def _ready(address: str) -> FakeRank:
    """Register the pool's one rank over ``address`` and make the pool READY."""
    rank = FakeRank(address, POOL, 0, 1, llama_like_specs(), 8 << 20)
    return rank.join()


@pytest.fixture
def sock(tmp_path: Path) -> str:
    return f"unix:{tmp_path / 'kvsvc.sock'}"


def test_engine_calls_ranks_ctl_and_health_over_the_socket(sock: str) -> None:
    with _serving(sock) as server:
        assert server.server.unix_sockets == [sock]
        assert server.server.port == 0
        assert Path(unix_path(sock)).is_socket()
        rank = _ready(sock)
        try:
            with KVCacheClient(sock, pool=POOL) as kv:
                assert kv.wait_until_ready(timeout=10).state == "READY"
                first = kv.allocate("r1", list(range(1, 40)), 39, start=True)
                assert first.ok and first.new_block_ids[0]
                step = kv.step()
                step.allocate("r1", [40], 1)
                step.allocate("r2", list(range(1, 40)), 39, start=True)
                results = step.send()
                assert [r.ok for r in results] == [True, True]
                assert results[1].num_cached_tokens == 32  # r1's two full blocks
                assert kv.free("r1", "r2") > 0
            assert check_grpc(sock, pool_health_name(POOL)).healthy
            ctl = subprocess.run(
                [sys.executable, "-m", "kvsvc", "ctl", "--server", sock, "pools"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert ctl.returncode == 0, ctl.stderr
            assert POOL in ctl.stdout and "READY" in ctl.stdout
        finally:
            rank.close()
    # A clean stop leaves no socket file behind.
    assert not os.path.exists(unix_path(sock))


def test_tcp_and_socket_serve_the_same_pools(sock: str) -> None:
    with _serving(f"127.0.0.1:0,{sock}") as server:
        assert server.server.port > 0 and server.server.unix_sockets == [sock]
        tcp = f"127.0.0.1:{server.server.port}"
        rank = _ready(tcp)
        try:
            with KVCacheClient(sock, pool=POOL) as over_socket:
                assert over_socket.allocate("s", [1] * 20, 20, start=True).ok
            with KVCacheClient(tcp, pool=POOL) as over_tcp:
                assert over_tcp.usage().num_requests == 1
                assert over_tcp.free("s") >= 0
        finally:
            rank.close()


def test_a_socket_a_live_server_serves_is_refused(sock: str) -> None:
    with _serving(sock) as first:
        with pytest.raises(ListenError, match="a running server listens on this socket"):
            ServerThread(_config(sock))
        # The first server still has its socket and answers on it.
        assert first.server.unix_sockets == [sock]
        assert check_grpc(sock).healthy


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(path))  # bound, never listening: what a killed server leaves
    left.close()
    assert path.is_socket()
    with _serving(f"unix:{path}"):
        assert check_grpc(f"unix:{path}").healthy


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: f"unix:{d}/missing/k.sock", "no such directory"),
        (lambda d: f"unix:{d}/file", "exists and is not a socket"),
        (lambda d: f"unix:{d}/{'x' * 120}.sock", "longer than 107 bytes"),
    ],
    ids=["missing-directory", "regular-file", "too-long"],
)
def test_a_path_that_cannot_be_a_socket_is_one_clear_line(
    tmp_path: Path, make: object, message: str
) -> None:
    (tmp_path / "file").write_text("not a socket")
    address = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ListenError) as caught:
        check_unix_bindable(address, what="gRPC", flag="--listen")
    text = str(caught.value)
    assert message in text and address in text and "--listen" in text
    # kvsvc serve says the same in one line and exits 1, starting nothing.
    result = subprocess.run(
        [sys.executable, "-m", "kvsvc", "serve", "--listen", address, *SERVE_REST],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "file").read_text() == "not a socket"


@pytest.mark.parametrize(
    "listen", ["unix:", "127.0.0.1:0,", "unix:/tmp/a.sock,unix:/tmp/a.sock", "nowhere"]
)
def test_listen_settings_of_the_wrong_form_are_config_errors(listen: str) -> None:
    with pytest.raises(ConfigError, match="listen"):
        _config(listen)


def test_serve_announces_the_socket(tmp_path: Path) -> None:
    """Beside a TCP listener the socket has its own line, before the serving line that
    tools wait for ('kvsvc serving on port N')."""
    sock = f"unix:{tmp_path / 'k.sock'}"
    child = spawn(
        "server",
        ["serve", "--listen", "127.0.0.1:0", "--listen", sock, *SERVE_REST],
    )
    try:
        started = time.monotonic()
        while not any(line.startswith("kvsvc serving on port") for line in child.lines):
            assert child.alive(), child.output()
            assert time.monotonic() - started < 60, child.output()
            time.sleep(0.05)
        lines = list(child.lines)
        serving = next(i for i, line in enumerate(lines) if line.startswith("kvsvc serving"))
        assert f"kvsvc listening on {sock}" in lines[:serving]
        assert check_grpc(sock).healthy
    finally:
        stop_all([child])


@contextmanager
def _umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.mark.parametrize(("configured", "expected"), [(None, 0o600), ("0660", 0o660)])
def test_sockets_get_their_configured_mode_whatever_the_umask(
    tmp_path: Path, configured: str | None, expected: int
) -> None:
    """Connecting to a Unix socket needs write permission on its file. Under a umask of
    000 the sockets used to be world-writable (anyone on the host could call the server);
    the gRPC and the framed socket both get unix_socket_mode (0600 unless configured),
    and an engine is served over both."""
    grpc_sock, frames_sock = tmp_path / "g.sock", tmp_path / "f.sock"
    extra = {} if configured is None else {"unix_socket_mode": configured}
    config = ServerConfig(
        pools=(PoolConfig(name=POOL, world_size=1, max_model_len=1024),),
        listen=f"unix:{grpc_sock}",
        frames_listen=f"unix:{frames_sock}",
        metrics_listen=None,
        **extra,  # type: ignore[arg-type]
    )
    with _umask(0):
        thread = ServerThread(config)
    try:
        for path in (grpc_sock, frames_sock):
            assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))
        rank = _ready(f"unix:{grpc_sock}")
        for target in (f"unix:{grpc_sock}", f"frames:unix:{frames_sock}"):
            with KVCacheClient(target, pool=POOL) as kv:
                assert kv.usage().pool == POOL
        rank.close()
    finally:
        thread.stop()


@pytest.mark.parametrize(
    ("mode", "message"),
    [("0400", "read and write"), ("999", "file mode"), (0o1777, "file mode"), ("rw", "file mode")],
)
def test_a_bad_socket_mode_is_a_config_error(mode: object, message: str) -> None:
    with pytest.raises(ConfigError, match=f"unix_socket_mode.*{message}"):
        ServerConfig(pools=(PoolConfig(name=POOL),), unix_socket_mode=mode)  # type: ignore[arg-type]
