"""The frames settings of ServerConfig: checked when the config is made, each error
naming the setting."""

from __future__ import annotations

import pytest

from kvsvc.server.config import ConfigError, PoolConfig, ServerConfig


def make(frames_listen: str | None, listen: str = "127.0.0.1:50051", **kwargs: int) -> ServerConfig:
    return ServerConfig(
        pools=(PoolConfig(name="p"),),
        listen=listen,
        metrics_listen=None,
        frames_listen=frames_listen,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("listen", "frames"),
    [
        ("127.0.0.1:50051", "127.0.0.1:50051"),
        ("127.0.0.1:50051,unix:/tmp/kf.sock", "unix:/tmp/kf.sock"),
        ("127.0.0.1:50051", "127.0.0.1:7000,127.0.0.1:50051"),
    ],
)
def test_a_frames_address_that_is_also_a_grpc_address_is_refused(listen: str, frames: str) -> None:
    with pytest.raises(ConfigError, match="frames_listen") as caught:
        make(frames, listen)
    assert "also a gRPC address" in str(caught.value)


def test_port_0_on_both_is_allowed() -> None:
    """Port 0: each listener picks its own free port, so they cannot clash."""
    assert make("127.0.0.1:0", listen="127.0.0.1:0").frames_listen == "127.0.0.1:0"


@pytest.mark.parametrize(
    "frames", ["nowhere", "unix:", "127.0.0.1:0,", "127.0.0.1:notaport", "unix:/a,unix:/a"]
)
def test_malformed_frames_addresses_are_config_errors(frames: str) -> None:
    with pytest.raises(ConfigError, match="frames_listen"):
        make(frames)


@pytest.mark.parametrize("bound", [0, 1_000_001])
def test_frames_max_connections_is_bounded(bound: int) -> None:
    with pytest.raises(ConfigError, match="frames_max_connections"):
        make("unix:/tmp/kf.sock", frames_max_connections=bound)


def test_no_frames_listen_is_the_default() -> None:
    config = ServerConfig(pools=(PoolConfig(name="p"),), metrics_listen=None)
    assert config.frames_listen is None and config.frames_max_connections == 1024


def test_the_wire_contract_and_the_limits_table_give_the_hello_timeout_the_code_has() -> None:
    """frames.proto is what a client in another language reads: it must state the bound
    the server applies (it said 10 s while the server closed the connection after 5)."""
    import re
    from pathlib import Path

    from kvsvc.server.transports.frames_listener import DEFAULT_HELLO_TIMEOUT_S

    repo = Path(__file__).resolve().parents[2]
    default = make(None).frames_hello_timeout_s
    assert default == DEFAULT_HELLO_TIMEOUT_S
    proto = " ".join((repo / "protos/kvsvc/v1/frames.proto").read_text().split())
    stated = re.findall(r"hello within [^;.]*?(\d+(?:\.\d+)?) s\b", proto.replace("// ", ""))
    assert stated == [f"{default:g}"], stated
    row = next(
        line
        for line in (repo / "docs/serving.md").read_text().splitlines()
        if "`frames_hello_timeout_s`" in line
    )
    assert f"| {default:g} s |" in row, row
