"""The framed transport from Node, with plain sockets and protobufjs: no gRPC at all.

tests/contract/node/frames_client.js implements the client side of
protos/kvsvc/v1/frames.proto from its comments alone (magic, hello, one frame per call)
and runs an engine's sequence against a live server with engine tokens; this test checks
what it saw against the server's own books. Needs node and the pinned npm packages of
tools/node (``make node-tools``); skipped locally without them, a failure in CI.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.server.config import PoolConfig
from tests.frames.helpers import frames_server, short_dir
from tests.server.harness import ServerThread
from tests.tooling import missing, require_tool

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "node" / "frames_client.js"
NODE_MODULES = ROOT / "tools" / "node" / "node_modules"
PROTOS = ROOT / "protos"
ENGINE_TOKEN = "node-frames-engine-token-0123"
AGENT_TOKEN = "node-frames-agent-token-01234"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerThread, str]]:
    with short_dir() as tmp:
        tokens = Path(tmp) / "engine.tokens"
        tokens.write_text(f"nodeengine {ENGINE_TOKEN}\n")
        with frames_server(
            f"unix:{tmp}/n.sock",
            pool=PoolConfig(name="p", world_size=1, max_model_len=256),
            engine_token_file=str(tokens),
            agent_token=AGENT_TOKEN,
            token=AGENT_TOKEN,
            blocks=32,
        ) as server:
            yield server, f"{tmp}/n.sock"


def run_node(socket_path: str, token: str | None) -> dict[str, object]:
    node = require_tool("node", "apt-get install nodejs npm, then make node-tools")
    if not (NODE_MODULES / "protobufjs").is_dir():
        missing("tools/node/node_modules", "run `make node-tools` (npm ci in tools/node)")
    result = subprocess.run(
        [node, str(SCRIPT), socket_path, str(PROTOS), "p", *([token] if token else [])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen: dict[str, object] = json.loads(result.stdout)
    return seen


def test_node_speaks_the_framed_transport_from_the_proto_alone(
    served: tuple[ServerThread, str],
) -> None:
    server, socket_path = served
    seen = run_node(socket_path, ENGINE_TOKEN)
    assert seen["hello"] == {"version": 1, "code": 0}
    assert seen["pools"] == [["p", "POOL_STATE_READY"]]
    epoch = server.run(lambda: server.server.pools.by_name["p"].events.epoch)
    assert seen["epoch"] == seen["admit_epoch"] == epoch
    block = seen["block_size"]
    assert isinstance(block, int) and block > 0
    admit = seen["admit"]
    assert isinstance(admit, dict)
    assert admit["status"] == "ALLOCATE_STATUS_OK" and admit["num_computed_tokens"] == 40
    assert sum(len(g["block_ids"]) for g in admit["new_blocks"]) == -(-40 // block)
    assert seen["continue"]["status"] == "ALLOCATE_STATUS_OK"  # type: ignore[index]
    assert seen["step"]["statuses"] == ["ALLOCATE_STATUS_OK"]  # type: ignore[index]
    assert seen["table"]["num_tokens"] == 42  # type: ignore[index]
    unknown = seen["unknown_pool"]["error"]  # type: ignore[index]
    assert unknown["code"] == 5 and "no-such-pool" in unknown["details"]
    assert seen["free"]["num_freed_blocks"] > 0  # type: ignore[index]
    assert seen["usage"]["num_requests"] == 0  # type: ignore[index]
    # The engine token names an engine: its requests lived in that engine's namespace.
    assert server.run(lambda: server.server.pools.by_name["p"].cache.num_requests) == 0


def test_node_without_a_token_is_refused_with_the_servers_message(
    served: tuple[ServerThread, str],
) -> None:
    """No token: the hello is refused with UNAUTHENTICATED and the server's reason (a
    server with tokens takes no unknown credential past the hello), and the connection
    closed."""
    _, socket_path = served
    seen = run_node(socket_path, None)
    assert seen["hello"] == {"version": 1, "code": 16}
    refused = seen["refused"]
    assert isinstance(refused, dict)
    assert refused["code"] == 16  # UNAUTHENTICATED
    assert "missing authorization metadata" in refused["details"]
    assert seen["closed"] is True
