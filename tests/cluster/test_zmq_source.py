"""kvsvc indexer --zmq-source: a vLLM-format ZMQ KV event stream (here kvsvc serve's own
--kv-events-zmq publisher, vLLM's wire format, hashes as ints or bytes) indexed next to a
kvsvc source, with real processes; Score equals the engine's Lookup."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports
from tests.cluster.redis_procs import RedisServer, free_port, require_redis_package
from tests.cluster.test_cluster_hybrid import HYBRID_SPECS
from tests.cluster.test_cluster_hybrid import MEMORY as HYBRID_MEMORY
from tests.cluster.test_cluster_index import MEMORY, SEED, SPECS, wait_for
from tests.tooling import missing

pytest.importorskip("torch")
require_redis_package()
try:
    import msgspec  # noqa: F401
    import zmq  # noqa: F401
except ImportError:
    missing("pyzmq and msgspec", "pip install -e '.[cluster]' (make venv installs them)")
pytestmark = [pytest.mark.e2e, pytest.mark.torch]


@pytest.fixture(
    params=[
        ("--kv-events-int-hashes", "dense"),
        ("--no-kv-events-int-hashes", "dense"),
        ("--kv-events-int-hashes", "hybrid"),
    ],
    ids=["int-hashes", "bytes-hashes", "hybrid"],
)
def zmq_engine(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[str, str, RedisServer, Path]]:
    """An engine publishing vLLM's format, hashes as 64-bit ints (vLLM's default) or as
    bytes, with full-attention layers or a full-attention and a sliding-window group (the
    indexer learns the groups from the events): the indexer reads each."""
    hash_flag, model = request.param
    seed, specs = tmp_path / "seed", tmp_path / "specs.json"
    seed.write_text(SEED)
    specs.write_text(json.dumps(SPECS if model == "dense" else HYBRID_SPECS))
    memory = MEMORY if model == "dense" else HYBRID_MEMORY
    pub, replay = free_port(), free_port()
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    children: list[Child] = []
    try:
        server = spawn("zmq-server", [
            "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", "p",
            "--max-model-len", "1024", "--hash-seed-file", str(seed), "--log-level", "WARNING",
            "--kv-events-zmq", f"tcp://*:{pub}", "--kv-events-replay", f"tcp://*:{replay}",
            hash_flag,
        ])  # fmt: skip
        children.append(server)
        port, _ = wait_for_ports(server)
        address = f"127.0.0.1:{port}"
        children.append(spawn("zmq-worker", [
            "worker", "--server", address, "--pool", "p", "--rank", "0", "--world-size", "1",
            "--device", "cpu", "--spec-file", str(specs), "--kv-cache-memory", memory,
        ]))  # fmt: skip
        with KVCacheClient(address, pool="p") as kv:
            kv.wait_until_ready(timeout=120)
        yield address, f"tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay}", redis, seed
    finally:
        stop_all(children)
        redis.stop()


def test_a_zmq_stream_is_indexed_like_the_engines_lookup(
    zmq_engine: tuple[str, str, RedisServer, Path],
) -> None:
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    address, source, redis, _ = zmq_engine
    rng = random.Random(3)
    systems = [[1000 * s + t for t in range(64)] for s in range(1, 4)]
    prompts = []
    with KVCacheClient(address, pool="p") as kv:
        # Made before the indexer subscribed: it finds them in the replay buffer.
        for i in range(4):
            prompt = systems[i % 3] + [rng.randrange(50_000) for _ in range(40)]
            kv.allocate(f"early{i}", prompt, len(prompt), start=True)
            kv.free(f"early{i}")
            prompts.append(prompt)
        indexer = spawn("zmq-indexer", [
            "indexer", "--redis", redis.url, "--metrics-listen", "off", "--zmq-source", source,
            "--zmq-hash-algo", "xxh3_128", "--log-level", "WARNING",
        ])  # fmt: skip
        try:
            scorer = Scorer(connect(redis.url), SEED)
            endpoint = source.partition(",")[0]
            wait_for(lambda: endpoint in scorer.score([1] * 20, max_registry_age=0).scores)
            for i in range(30):  # enough to evict: removals are indexed too
                prompt = rng.choice(systems) + [rng.randrange(50_000) for _ in range(60)]
                assert kv.allocate(f"r{i}", prompt, len(prompt), start=True).ok
                kv.free(f"r{i}")
                prompts.append(prompt)

            def matches() -> bool:
                return all(
                    scorer.score(p, max_registry_age=0).scores == {endpoint: kv.lookup(p)}
                    for p in [*prompts, *systems]
                )

            wait_for(matches, timeout=20, what="the ZMQ source's index to match its lookups")
            assert any(kv.lookup(p) for p in prompts[:4]), "the early blocks are still cached"
        finally:
            indexer.stop(5)
