"""Route end to end: two real `kvsvc serve` pools, `kvsvc indexer` writing their events and
their live load (GetUsage) into a real redis-server, `kvsvc router` answering Route over
gRPC, and `kvsvc ctl route` from a shell. The fleet is the replay's (its ranks register
without tensors: no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.cluster.route import RoutePolicy
from kvsvc.cluster.router import ClusterIndexClient, RouteAnswer
from kvsvc.replay.fleet import POOL, Fleet
from tests.cluster.redis_procs import RedisServer, require_redis_package

require_redis_package()
pytestmark = pytest.mark.e2e

PROMPT = list(range(1000, 1064))  # 4 blocks of 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("route-e2e")
    redis = RedisServer(tmp / "redis")
    redis.start()
    fleet = Fleet(2, 16, 256, 1024, redis.url, "e2e", RoutePolicy(), 0.05, 5.0, tmp)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
        redis.stop()


def route_until(
    fleet: Fleet, engine: str, running: int, tokens: list[int], deadline_s: float = 30.0
) -> RouteAnswer:
    """Route ``tokens`` until ``engine``'s reported load is ``running`` (the indexer
    writes it every 50 ms); the answer that saw it. A fresh client each time: the
    router's routed-since counts are its own, a report clears them."""
    deadline = time.monotonic() + deadline_s
    with ClusterIndexClient(fleet.router_address) as router:
        while True:
            answer = router.route(tokens)
            seen = [c for c in (answer.chosen, answer.runner_up) if c and c.engine == engine]
            if (
                seen
                and seen[0].reported
                and seen[0].num_running_requests == running
                and seen[0].num_routed_since_report == 0
            ):
                return answer
            assert time.monotonic() < deadline, f"{engine} never reported {running}: {answer}"
            time.sleep(0.05)


def test_route_weighs_the_load_the_engines_report(fleet: Fleet) -> None:
    """Engine A caches a prompt's first block and runs four requests; B runs none: Route
    sends a prompt sharing that block to B, decided by the load. Once A's requests end,
    its cached prefix wins again."""
    a, b = fleet.sources
    with KVCacheClient(fleet.addresses[0], POOL) as kv:
        ids = [f"busy{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            tokens = PROMPT[:16] + [5000 + 100 * i + t for t in range(48)]
            assert kv.allocate(rid, tokens, len(tokens), start=True).ok
        answer = route_until(fleet, a, 4, PROMPT)
        assert (answer.chosen.engine, answer.decided_by) == (b, "load")
        assert answer.runner_up is not None and answer.runner_up.num_cached_tokens == 16
        # The shared first block once, three of each request's own.
        assert answer.runner_up.num_used_blocks == 13 and answer.runner_up.num_blocks == 256
        kv.free(*ids)
    answer = route_until(fleet, a, 0, PROMPT)
    assert (answer.chosen.engine, answer.chosen.num_cached_tokens) == (a, 16)
    assert answer.decided_by == "prefix"


def test_ctl_route_asks_from_a_shell(fleet: Fleet, tmp_path: Path) -> None:
    a, _ = fleet.sources
    prompt_file = tmp_path / "prompt"
    prompt_file.write_text(" ".join(map(str, PROMPT)))
    route_until(fleet, a, 0, PROMPT)
    common = [
        sys.executable, "-m", "kvsvc", "ctl", "route", "--redis", fleet.redis_url,
        "--key-prefix", fleet.key_prefix, "--hash-seed-file", str(fleet.seed_file),
        "--tokens-file", str(prompt_file),
    ]  # fmt: skip
    result = subprocess.run([*common, "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["chosen"]["engine"] == a and answer["decided_by"] == "prefix"
    assert answer["chosen"]["num_cached_tokens"] == 16
    assert answer["chosen"]["load"]["reported"] is True
    assert answer["policy"] == {"prefix_weight": 1.0, "load_weight": 0.25, "load_floor": 1.0}
    # The plain form, with another weight: the cache ignored, the load alone decides.
    result = subprocess.run(
        [*common, "--prefix-weight", "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("chosen ") and "decided by: " in result.stdout
    # A bad weight is named, nothing asked.
    result = subprocess.run(
        [*common, "--load-weight", "-1"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--load-weight" in result.stderr
