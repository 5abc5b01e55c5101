"""Route against real redis-servers (one, and a 3-node Redis Cluster): the index written by
the indexer's own store, loads by its own publisher, answered by the router's Router and
over gRPC. The load must count: a busy engine loses a short prefix to an idle one, a
missing or stale load is the mean, routes count until the next report, ties rotate."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvsvc.cluster.hashing import PromptHasher
from kvsvc.cluster.layout import Keys
from kvsvc.cluster.load import RECORD, LoadPublisher
from kvsvc.cluster.route import RoutePolicy, Router
from kvsvc.cluster.score import HashesPrompt, Scorer, TokenPrompt
from kvsvc.cluster.store import SourceStore, Tracking, connect
from kvsvc.errors import FailedPrecondition, InvalidArgument
from tests.cluster.redis_procs import redis_deployment, require_redis_package

require_redis_package()

SEED = "route-test-seed"
HASHER = PromptHasher("xxh3_128", SEED)
TRACKING = Tracking((0,), 16, 16, "xxh3_128", HASHER.fingerprint)
_prefixes = itertools.count()
A, B, C, D = (f"10.0.0.{i}:50051/p" for i in range(1, 5))


@pytest.fixture(scope="module", params=["single", "cluster"])
def redis_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with redis_deployment(tmp_path_factory.mktemp(f"redis-{request.param}"), request.param) as url:
        yield url


class Index:
    """A fresh index (its own key prefix) with engines, their cached blocks and loads."""

    def __init__(self, url: str) -> None:
        self.client = connect(url)
        self.keys = Keys(f"route{next(_prefixes)}")
        self.stores: dict[str, SourceStore] = {}
        self.loads = LoadPublisher(self.client, self.keys, ttl_s=60)

    def engine(self, name: str, cached: Sequence[int] = (), running: int | None = None) -> None:
        """Index ``name`` caching the full blocks of ``cached``, reporting ``running``
        requests (None: no report)."""
        store = self.stores.get(name)
        if store is None:
            store = self.stores[name] = SourceStore(self.client, name, "test", self.keys)
            store.acquire()
        hashes = HASHER.block_hashes(cached, 16, 16) if cached else []
        store.install("epoch", 0, TRACKING, {b"\0" + h: 1 for h in hashes})
        if running is not None:
            self.load(name, running)

    def load(self, name: str, running: int) -> None:
        self.loads.publish(self.stores[name].ensure_id(), running, running * 4, 1000)

    def router(self, policy: RoutePolicy | None = None) -> Router:
        return Router(Scorer(self.client, SEED, self.keys), policy)


@pytest.fixture
def index(redis_url: str) -> Index:
    return Index(redis_url)


def prompt(blocks: int, base: int = 0) -> list[int]:
    return [base + t for t in range(16 * blocks)]


def test_a_busy_engine_loses_a_short_prefix_to_an_idle_one(index: Index) -> None:
    """A caches 1 block of a 4-block prompt but runs 4 requests, B runs none: the load
    term (0.25 x relative load x 64 tokens: 4 x 16 for A) outweighs 16 cached tokens. Routing
    by the prefix alone (load weight 0) would pick A."""
    p = prompt(4)
    index.engine(A, p[:16], running=4)
    index.engine(B, running=0)
    answer = index.router().route(TokenPrompt(p))
    assert (answer.chosen.engine, answer.decided_by) == (B, "load")
    assert answer.runner_up is not None and answer.runner_up.engine == A
    assert answer.runner_up.cached == 16 and answer.runner_up.report is not None
    assert answer.runner_up.report.running == 4 and answer.runner_up.relative == 4.0
    prefix_only = index.router(RoutePolicy(1.0, 0.0)).route(TokenPrompt(p))
    assert (prefix_only.chosen.engine, prefix_only.decided_by) == (A, "prefix")


def test_a_long_prefix_outweighs_a_small_load_difference(index: Index) -> None:
    p = prompt(8)
    index.engine(A, p, running=2)  # 112 of 128 tokens cached (one left to compute)
    index.engine(B, running=1)
    answer = index.router().route(TokenPrompt(p))
    assert (answer.chosen.engine, answer.chosen.cached, answer.decided_by) == (A, 112, "prefix")


def test_a_missing_or_stale_load_counts_the_mean(index: Index) -> None:
    """C never reported and D's report is past its TTL: each counts the mean of those that
    did (A 2, B 4: 3), so neither is shunned (as an infinite load) nor flooded (as
    zero)."""
    index.engine(A, running=2)
    index.engine(B, running=4)
    index.engine(C)
    index.engine(D, running=0)
    stale = RECORD.pack(1.0, 1000, 0, 0, 1000)  # written at Redis time 1 ms, long gone
    index.client.setrange(index.keys.load, index.stores[D].ensure_id() * RECORD.size, stale)
    for missing in (C, D):
        answer = index.router().route(TokenPrompt(prompt(2)), [A, B, missing])
        assert answer.chosen.engine == A and answer.decided_by == "load"
        assert answer.runner_up is not None and answer.runner_up.engine == missing
        assert answer.runner_up.report is None and answer.runner_up.load == 3.0
    # Neither has a report: both at the (empty) mean; the prompts spread over them.
    router = index.router()
    chosen = {router.route(TokenPrompt(prompt(2, 100 * i)), [C, D]).chosen.engine for i in range(2)}
    assert chosen == {C, D}


def test_equal_scores_rotate_over_the_tied_engines(index: Index) -> None:
    """Nothing cached, equal loads: never "the first engine" every time. With the routes
    counted as load, eight prompts over four engines land two on each."""
    for name in (A, B, C, D):
        index.engine(name, running=1)
    router = index.router()
    answers = [router.route(TokenPrompt(prompt(2, base=100 * i))) for i in range(8)]
    counts = {name: sum(a.chosen.engine == name for a in answers) for name in (A, B, C, D)}
    assert counts == {A: 2, B: 2, C: 2, D: 2}
    assert answers[0].decided_by == "tie"
    # Prefix only (load weight 0): nothing tells the engines apart but the rotation.
    prefix_only = index.router(RoutePolicy(1.0, 0.0))
    chosen = [prefix_only.route(TokenPrompt(prompt(2, 5000 + 100 * i))) for i in range(4)]
    assert sorted(a.chosen.engine for a in chosen) == sorted((A, B, C, D))
    assert {a.decided_by for a in chosen} == {"tie"}


def test_routes_count_as_load_until_the_next_report(index: Index) -> None:
    """A stale load (the reports do not change) never sends everything to one engine: A
    caches most of the prompt, yet the prompts routed to it since its report make it the
    busiest, and some go elsewhere. A new report of A resets what it counts."""
    p = prompt(8)
    index.engine(A, p, running=0)
    index.engine(B, running=0)
    router = index.router()
    chosen = [router.route(TokenPrompt(p)).chosen.engine for _ in range(12)]
    assert chosen[0] == A and B in chosen
    index.load(A, 0)  # A reports again: what was routed to it before is in the report
    answer = router.route(TokenPrompt(p))
    assert answer.chosen.engine == A and answer.chosen.routed_since == 0


def test_block_hashes_route_as_the_tokens_do(index: Index) -> None:
    p = prompt(6)
    index.engine(A, p[:64], running=1)
    index.engine(B, p[:32], running=0)
    router = index.router(RoutePolicy(1.0, 0.1))
    by_tokens = router.route(TokenPrompt(p))
    hashes = HASHER.block_hashes(p, 16, 16)
    by_hashes = index.router(RoutePolicy(1.0, 0.1)).route(HashesPrompt(hashes, 16, len(p)))
    assert by_tokens.chosen.engine == by_hashes.chosen.engine == A
    assert by_tokens.chosen.cached == by_hashes.chosen.cached == 64
    # Hashes at another block size say nothing of these engines: nothing cached.
    other = router.route(HashesPrompt(HASHER.block_hashes(p, 16, 32), 32, len(p)))
    assert other.chosen.cached == 0 and other.runner_up is not None
    assert other.runner_up.cached == 0


def test_candidates_and_no_engine(index: Index) -> None:
    """A named engine the index does not hold is a candidate with nothing cached and the
    mean load; with nothing indexed and nothing named there is nothing to choose."""
    with pytest.raises(FailedPrecondition, match="none is indexed"):
        index.router().route(TokenPrompt(prompt(2)))
    index.engine(A, running=3)
    index.engine(B, running=9)
    router = index.router()
    router.route(TokenPrompt(prompt(2)))  # every engine: A and B
    answer = router.route(TokenPrompt(prompt(2, 500)), [A, "10.9.9.9:1/new"])
    assert answer.num_candidates == 2
    new = answer.chosen if answer.chosen.engine != A else answer.runner_up
    assert new is not None and new.engine == "10.9.9.9:1/new" and new.report is None
    assert new.load == 3.0  # the mean of the candidates that reported: A's, not B's


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        (RoutePolicy(-1.0, 0.5), "policy.prefix_weight"),
        (RoutePolicy(1.0, float("nan")), "policy.load_weight"),
        (RoutePolicy(1.0, 0.5, 0.0), "policy.load_floor"),
        (RoutePolicy(1.0, 2e6), "policy.load_weight"),
    ],
)
def test_a_bad_policy_is_refused_naming_its_field(
    index: Index, policy: RoutePolicy, field: str
) -> None:
    index.engine(A, running=0)
    with pytest.raises(InvalidArgument, match=field):
        index.router().route(TokenPrompt(prompt(2)), policy=policy)


def test_route_over_grpc_is_a_read_the_routers_tokens_guard(index: Index, tmp_path: Path) -> None:
    """Route through `create_router` with a token: refused without it (UNAUTHENTICATED),
    answered with it; a bad policy is INVALID_ARGUMENT naming the field."""
    from kvsvc_client import InvalidArgumentError, UnauthenticatedError

    from kvsvc.cluster.router import ClusterIndexClient, create_router

    p = prompt(4)
    index.engine(A, p[:16], running=4)
    index.engine(B, running=0)
    scorer = Scorer(index.client, SEED, index.keys)
    server, port = create_router(scorer, "127.0.0.1:0", ["secret"])
    try:
        with (
            ClusterIndexClient(f"127.0.0.1:{port}") as anonymous,
            pytest.raises(UnauthenticatedError),
        ):
            anonymous.route(p)
        with ClusterIndexClient(f"127.0.0.1:{port}", token="secret") as client:
            answer = client.route(p)
            assert (answer.chosen.engine, answer.decided_by) == (B, "load")
            assert answer.runner_up is not None and answer.runner_up.num_running_requests == 4
            assert answer.policy == RoutePolicy()
            with pytest.raises(InvalidArgumentError, match=r"policy\.load_weight"):
                client.route(p, policy=RoutePolicy(1.0, -1.0))
            with pytest.raises(InvalidArgumentError, match="block_hashes"):
                client.route(p, block_hashes=[b"x" * 16], block_size=16, num_prompt_tokens=64)
    finally:
        server.stop(None)


def test_the_load_record_is_what_the_script_writes(index: Index) -> None:
    """The Lua script's struct.pack and Python's RECORD agree (field order, widths)."""
    index.engine(A)
    engine = index.stores[A].ensure_id()
    index.loads.publish(engine, 7, 300, 1000)
    seconds, micros = index.client.time()
    end = (engine + 1) * RECORD.size - 1
    stamp, *fields = RECORD.unpack(
        index.client.getrange(index.keys.load, engine * RECORD.size, end)
    )
    assert fields == [60_000, 7, 300, 1000]
    assert 0 < seconds * 1000 + micros / 1000 - stamp < 60_000
    assert struct.calcsize(">dIIII") == RECORD.size == 24
