"""kvsvc driven from Node's @grpc/grpc-js, as an engine in another language would.

The Node side (tests/contract/node/engine_client.js) runs an engine's whole sequence from
the .proto files, then works with nothing but server reflection (grpc.reflection.v1):
health and AdminService through descriptors it fetched. Needs node and the pinned npm
packages of tools/node (``make node-tools``); skipped locally without them, a failure in CI.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from kvsvc.server.config import PoolConfig
from tests.server.harness import ServerThread, bring_up, running_server
from tests.tooling import missing, require_tool

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "node" / "engine_client.js"
NODE_MODULES = ROOT / "tools" / "node" / "node_modules"
PROTOS = ROOT / "protos"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(PoolConfig(name="p", max_model_len=256)) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=64 * 32 * 1024)
        yield srv
        for rank in ranks:
            rank.close()


def _reflection_descriptor_set(path: Path) -> Path:
    """grpc.reflection.v1's descriptor (the server registers it) as a FileDescriptorSet."""
    import kvsvc.server.transports.reflection as reflection

    reflection._register_v1_descriptor()
    file = descriptor_pool.Default().FindFileByName("grpc/reflection/v1/reflection.proto")
    files = descriptor_pb2.FileDescriptorSet()
    file.CopyToProto(files.file.add())
    path.write_bytes(files.SerializeToString())
    return path


def test_node_drives_the_engine_sequence_and_a_reflection_only_client(
    server: ServerThread, tmp_path: Path
) -> None:
    node = require_tool("node", "apt-get install nodejs npm, then make node-tools")
    if not (NODE_MODULES / "@grpc" / "grpc-js").is_dir():
        missing("tools/node/node_modules", "run `make node-tools` (npm ci in tools/node)")
    descriptor_set = _reflection_descriptor_set(tmp_path / "reflection.pb")
    result = subprocess.run(
        [node, str(SCRIPT), server.address, str(PROTOS), str(descriptor_set), "p"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    engine = seen["engine"]
    assert engine["pools"] == [["p", "POOL_STATE_READY"]]
    block = engine["block_size"]
    assert engine["admit"]["status"] == "ALLOCATE_STATUS_OK"
    assert engine["admit"]["num_computed_tokens"] == 40
    assert sum(len(g["block_ids"]) for g in engine["admit"]["new_blocks"]) == -(-40 // block)
    assert engine["continue"]["status"] == "ALLOCATE_STATUS_OK"
    assert engine["no_start"]["error"]["code"] == 5  # NOT_FOUND
    assert "first call needs start" in engine["no_start"]["error"]["details"]
    assert engine["step"]["statuses"] == ["ALLOCATE_STATUS_OK"]
    assert engine["lookup"]["num_cached_tokens"] == (40 // block) * block - (
        block if 40 % block == 0 else 0
    )
    assert engine["table"]["num_tokens"] == 42
    assert engine["free"]["num_freed_blocks"] > 0
    assert engine["usage"]["num_requests"] == 0
    assert engine["events"]["sequence"] == 1 and "stored" in engine["events"]["kinds"]
    reflected = seen["reflection"]
    assert "kvsvc.v1.KVCacheService" in reflected["services"]
    assert "grpc.reflection.v1.ServerReflection" in reflected["services"]
    assert reflected["health"]["status"] == "SERVING"
    assert reflected["pools"] == ["p"]
