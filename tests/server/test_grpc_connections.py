"""Who holds a gRPC connection, and for how long: a cap below the open-file limit, a
handshake deadline and an idle bound (grpc_max_connections, grpc_handshake_timeout_s,
grpc_idle_timeout_s; the framed listener's own are in tests/frames). A real ``kvsvc
serve`` under a 400-descriptor limit, crowded by bare TCP connections and idle channels,
keeps serving an engine's Lookup and gives every descriptor back."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from kvsvc_client import ClientOptions, KVCacheClient

from kvsvc.demo.processes import Child, wait_for_ports
from tests.server.harness import FakeRank, llama_like_specs
from tests.tooling import wait_for

FD_LIMIT = 400
TIMEOUT_S = 1.0  # the handshake and idle bounds here
POOL = "p"


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, str]]:
    config = tmp_path_factory.mktemp("grpc-conn") / "server.toml"
    config.write_text(
        f"grpc_handshake_timeout_s = {TIMEOUT_S}\ngrpc_idle_timeout_s = {TIMEOUT_S}\n"
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

    args = ["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", POOL]
    args += ["--max-model-len", "256", "--config", str(config), "--log-level", "WARNING"]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvsvc", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=limit,
        start_new_session=True,
    )
    child = Child("server", process)
    child.start_reader()
    try:
        port, _ = wait_for_ports(child)
        address = f"127.0.0.1:{port}"
        rank = FakeRank(address, POOL, 0, 1, llama_like_specs(), 64 * 32 * 1024).join()
        yield child, address
        rank.close()
    finally:
        child.stop()


def _lookup(address: str) -> int:
    """An engine's Lookup on a new channel: its client retries (UNAVAILABLE) while the
    server has no connection for it, for up to ~20 s."""
    options = ClientOptions(timeout=5, retries=30, max_backoff=1.0)
    with KVCacheClient(address, pool=POOL, options=options) as kv:
        return kv.lookup(list(range(64)))


def test_bare_connections_past_the_descriptor_limit_do_not_lock_out_an_engine(
    server: tuple[Child, str],
) -> None:
    """420 TCP connections that never speak HTTP/2, against a 400-descriptor limit: the
    cap (half the limit) closes those past it at once and the handshake deadline the
    rest, so the server never runs out of descriptors and an engine's Lookup is served.
    Before, accept() hit the limit and gRPC retried it for ever: the Lookup failed."""
    child, address = server
    pid = child.process.pid
    host, _, port = address.rpartition(":")
    before = _descriptors(pid)
    # The server's descriptors are sampled while the connections arrive and while it
    # accepts them (a loaded machine may accept late): one sample could come too early.
    peak = [before]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            with contextlib.suppress(OSError):
                peak.append(_descriptors(pid))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    bare = [socket.create_connection((host, int(port)), timeout=5) for _ in range(420)]
    try:
        time.sleep(TIMEOUT_S / 2)  # accepted by now, the handshake deadline not yet due
        sampling.set()
        sampler.join()
        assert max(peak) <= before + FD_LIMIT // 2 + 8
        assert _lookup(address) == 0
        wait_for(lambda: _descriptors(pid) <= before + 8, timeout=30, what="bare ones closed")
    finally:
        for sock in bare:
            sock.close()
    assert child.alive()


def test_idle_channels_are_closed_and_give_their_descriptors_back(
    server: tuple[Child, str],
) -> None:
    """Channels that connect (HTTP/2 and all) and make no call, as in the attack of issue
    32 that held 300 of them for 200 s (150 here: under the cap of 200): each is closed
    after grpc_idle_timeout_s."""
    child, address = server
    pid = child.process.pid
    before = _descriptors(pid)
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection each
    channels = [grpc.insecure_channel(address, options=options) for _ in range(150)]
    try:
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=10)
        wait_for(lambda: _descriptors(pid) <= before + 8, timeout=30, what="idle ones closed")
        assert _lookup(address) == 0
    finally:
        for channel in channels:
            channel.close()


def test_the_connection_cap_follows_the_descriptor_limit() -> None:
    from kvsvc.server.config import PoolConfig, ServerConfig
    from kvsvc.server.transports.grpc_listener import grpc_max_connections

    pools = (PoolConfig(name=POOL),)
    assert grpc_max_connections(ServerConfig(pools=pools, grpc_max_connections=7)) == 7
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    expected = 1024 if soft == resource.RLIM_INFINITY else max(16, min(1024, soft // 2))
    assert grpc_max_connections(ServerConfig(pools=pools)) == expected
