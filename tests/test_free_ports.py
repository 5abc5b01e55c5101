"""No test binds a fixed port: kvsvc's default addresses are held for the whole session
(tests/conftest.py, tests/ports.py), so a test server left on one fails here, every time."""

from __future__ import annotations

import socket

import pytest

from kvsvc.ports import ListenError
from kvsvc.server.config import PoolConfig, ServerConfig, split_host_port
from tests.ports import DEFAULT_ADDRESSES, DefaultPortHolder
from tests.server.harness import ServerThread


@pytest.mark.parametrize("address", DEFAULT_ADDRESSES)
def test_every_default_address_is_taken_while_the_tests_run(address: str) -> None:
    host, port = split_host_port(address, "address")
    with socket.socket() as sock, pytest.raises(OSError, match="in use"):
        sock.bind((host, port))


def test_a_test_server_left_on_the_default_metrics_port_fails_to_start() -> None:
    """What tests/server/test_state_store.py's server did: its ServerConfig kept the
    default /metrics address. Here it cannot pass by luck."""
    config = ServerConfig(pools=(PoolConfig(name="p", world_size=1),), listen="127.0.0.1:0")
    with pytest.raises(ListenError, match=r"9400.*already in use"):
        ServerThread(config).stop()


def test_a_client_of_a_default_address_fails_fast(default_ports_held: DefaultPortHolder) -> None:
    """A client that dials a held default address is closed at once, as by a closed port:
    a test that (wrongly) dials one fails quickly instead of hanging to its deadline."""
    if DEFAULT_ADDRESSES[0] in default_ports_held.held_elsewhere:
        pytest.skip(f"another process holds {DEFAULT_ADDRESSES[0]}: it answers, not the suite")
    host, port = split_host_port(DEFAULT_ADDRESSES[0], "address")
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.settimeout(5)
        assert sock.recv(1) == b""
