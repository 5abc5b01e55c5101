"""``kvsvc indexer`` runs with the indexer role: a real indexer process follows a server
that has tokens with an indexer token alone (no operator token in its environment), and
that token may do nothing an indexer does not (the auth matrix of tests/server/test_auth.py
checks every method)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvsvc_client import ClientOptions, KVCacheClient, PermissionDeniedError

from kvsvc.cluster.layout import Keys
from kvsvc.demo.processes import spawn
from kvsvc.server.config import PoolConfig
from tests.cluster.redis_procs import RedisServer, require_redis_package
from tests.server.harness import ServerThread, bring_up, running_server
from tests.tooling import wait_for

ENGINE = "engine-token-0123456789abc"
AGENT = "agent-token-0123456789abcd"
ADMIN = "admin-token-0123456789abcd"
INDEXER = "indexer-token-0123456789ab"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    files = {}
    for role, token in (
        ("engine", ENGINE),
        ("agent", AGENT),
        ("admin", ADMIN),
        ("indexer", INDEXER),
    ):
        (tmp_path / role).write_text(f"{token}\n")
        files[f"{role}_token_file"] = str(tmp_path / role)
    with running_server(PoolConfig(name="p", max_model_len=256), **files) as srv:
        ranks = bring_up(srv, "p", kv_cache_bytes=64 * 32 * 1024, token=AGENT)
        yield srv
        for rank in ranks:
            rank.close()


def test_the_indexer_follows_a_server_with_an_indexer_token(
    server: ServerThread, tmp_path: Path
) -> None:
    require_redis_package()
    with KVCacheClient(server.address, pool="p", options=ClientOptions(token=ENGINE)) as kv:
        assert kv.allocate("r", list(range(64)), 64, start=True).ok
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    indexer = spawn(
        "indexer",
        [
            "indexer", "--redis", redis.url, "--source", f"{server.address}/p",
            "--metrics-listen", "off", "--log-level", "INFO",
        ],
        env={"KVSVC_INDEXER_TOKEN": INDEXER, "KVSVC_ADMIN_TOKEN": "", "KVSVC_AUTH_TOKEN": ""},
    )  # fmt: skip
    try:
        wait_for(
            lambda: any("snapshot (new)" in line for line in indexer.lines),
            timeout=30,
            what="the indexer's first snapshot",
        )
        # The load Route weighs: the indexer's GetUsage is allowed, its report is in Redis.
        import redis as redis_py

        load_key = Keys().load
        with redis_py.Redis.from_url(redis.url) as client:
            wait_for(lambda: client.exists(load_key), timeout=30, what="the indexer's load report")
        assert not any("UNAUTHENTICATED" in line or "PERMISSION" in line for line in indexer.lines)
    finally:
        indexer.stop(5)
        redis.stop()
    # What the indexer's token may not do: use the engine API, or reset a pool.
    with KVCacheClient(server.address, pool="p", options=ClientOptions(token=INDEXER)) as kv:
        with pytest.raises(PermissionDeniedError, match="this token is indexer"):
            kv.reset_prefix_cache()
        with pytest.raises(PermissionDeniedError, match="this token is indexer"):
            kv.allocate("x", [1, 2], 2, start=True)
