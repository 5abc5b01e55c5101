"""The cluster index with real processes: three `kvsvc serve` (one on a state directory),
each with a `kvsvc worker --device cpu`, engines driving shared-prefix traffic, `kvsvc
indexer` into a real redis-server (and a second one into a 3-node Redis Cluster), and
Score checked against every engine's own Lookup. Then faults: Redis restarted empty, the
indexer killed and restarted, a server restarted with and without its state, a server
gone for good; after each the index equals the union of the live engines' indexes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvsvc_client import KVCacheClient

from kvsvc.demo.processes import Child, spawn, wait_for_ports
from tests.cluster.redis_procs import RedisServer, create_cluster, free_port, require_redis_package
from tests.tooling import wait_for

pytest.importorskip("torch")
require_redis_package()
pytestmark = [pytest.mark.e2e, pytest.mark.torch]

SEED = "the-cluster-test-seed-0123456789"
# Two full-attention layers of 2 x 64 fp16 heads: 16 KiB blocks, 96 of them in 1.5 MiB
# (few enough that the traffic evicts).
SPECS = {
    f"model.layers.{i}.self_attn.attn": {
        "type": "full_attention", "block_size": 16, "num_kv_heads": 2, "head_size": 64,
        "dtype": "float16",
    }
    for i in range(2)
}  # fmt: skip
MEMORY = "1536KiB"
SYSTEM_PROMPTS = [[1000 * s + t for t in range(64)] for s in range(1, 4)]
# How far behind the engines the index may be once their traffic pauses, seconds.
LAG_BOUND_S = 2.0


@dataclass
class Engine:
    """One kvsvc server and its CPU agent, at a fixed port so it restarts in place."""

    name: str
    port: int
    seed_file: Path
    spec_file: Path
    state_dir: Path | None
    server: Child | None = None
    worker: Child | None = None
    kv_cache_memory: str = MEMORY  # the worker's --kv-cache-memory
    serve_args: tuple[str, ...] = ()  # more `kvsvc serve` flags

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def source(self) -> str:
        return f"{self.address}/p"

    def start_server(self) -> None:
        args = [
            "serve", "--listen", self.address, "--metrics-listen", "off", "--pool", "p",
            "--max-model-len", "1024", "--hash-seed-file", str(self.seed_file),
            "--log-level", "WARNING", "--heartbeat-timeout", "3",
        ]  # fmt: skip
        if self.state_dir is not None:
            args += ["--state-dir", str(self.state_dir)]
        self.server = spawn(f"{self.name}-server", [*args, *self.serve_args])
        wait_for_ports(self.server)

    def start_worker(self) -> None:
        self.worker = spawn(
            f"{self.name}-worker",
            [
                "worker", "--server", self.address, "--pool", "p", "--rank", "0",
                "--world-size", "1", "--device", "cpu", "--spec-file", str(self.spec_file),
                "--kv-cache-memory", self.kv_cache_memory, "--heartbeat-interval", "0.5",
            ],
        )  # fmt: skip

    def wait_ready(self) -> None:
        with KVCacheClient(self.address, pool="p") as kv:
            kv.wait_until_ready(timeout=120)

    def stop_server(self, kill: bool = False) -> None:
        assert self.server is not None
        if kill:
            self.server.process.kill()
        self.server.stop(5)
        self.server = None

    def stop(self) -> None:
        for child in (self.worker, self.server):
            if child is not None:
                child.stop(5)


@dataclass
class Fleet:
    engines: list[Engine]
    redis: RedisServer
    cluster_nodes: list[RedisServer]
    seed_file: Path
    tmp: Path
    indexers: dict[str, Child] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    held: dict[str, list[str]] = field(default_factory=dict)  # running requests per engine

    def start_indexer(self, name: str, url: str, *extra: str) -> Child:
        args = ["indexer", "--redis", url, "--metrics-listen", "127.0.0.1:0"]
        for engine in self.engines:
            args += ["--source", engine.source]
        args += ["--lease-ttl", "1.5", "--purge-after", "3", "--log-level", "WARNING", *extra]
        child = spawn(name, args)
        wait_for(lambda: any("kvsvc indexer following" in line for line in child.lines), what=name)
        self.indexers[name] = child
        return child

    def live(self) -> list[Engine]:
        return [e for e in self.engines if e.server is not None]

    def traffic(self, rounds: int = 12) -> list[list[int]]:
        """Shared-prefix requests on every live engine: a system prompt and a user turn,
        some finished (their blocks stay cached), some kept running. Returns prompts."""
        prompts = []
        for engine in self.live():
            with KVCacheClient(engine.address, pool="p") as kv:
                for i in range(rounds):
                    system = self.rng.choice(SYSTEM_PROMPTS)
                    user = [self.rng.randrange(50_000) for _ in range(self.rng.randrange(20, 90))]
                    prompt = system + user
                    request = f"{engine.name}-{time.monotonic_ns()}-{i}"
                    held = self.held.setdefault(engine.name, [])
                    if len(held) >= 3:  # a few running at a time: the pool never fills
                        kv.free(held.pop(0))
                    assert kv.allocate(request, prompt, len(prompt), start=True).ok
                    if i % 3:
                        kv.free(request)
                    else:
                        held.append(request)
                    prompts.append(prompt)
        return prompts

    def lookups(self, prompt: list[int]) -> dict[str, int]:
        found = {}
        for engine in self.live():
            with KVCacheClient(engine.address, pool="p") as kv:
                found[engine.source] = kv.lookup(prompt)
        return found


def scores(url: str, prompt: list[int], tmp: Path, seed_file: Path) -> dict[str, int]:
    """`kvsvc ctl score --json`, the command line's contract."""
    tokens = tmp / "prompt.txt"
    tokens.write_text(" ".join(map(str, prompt)) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvsvc", "ctl", "score", "--redis", url, "--tokens-file",
         str(tokens), "--json", "--hash-seed-file", str(seed_file)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["scores"]  # type: ignore[no-any-return]


def assert_index_matches(fleet: Fleet, url: str, prompts: list[list[int]]) -> None:
    """Score (through the library, then once through `kvsvc ctl score`) equals every live
    engine's Lookup for each prompt, and lists exactly the live engines."""
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    scorer = Scorer(connect(url), SEED)
    checked = [*prompts[:: max(1, len(prompts) // 8)], *SYSTEM_PROMPTS]

    def matches() -> bool:
        return all(scorer.score(p, max_registry_age=0).scores == fleet.lookups(p) for p in checked)

    try:
        wait_for(matches, timeout=20, what="the index to match the engines' lookups")
    except AssertionError:
        bad = next(p for p in checked if scorer.score(p).scores != fleet.lookups(p))
        pytest.fail(f"score {scorer.score(bad).scores} != lookups {fleet.lookups(bad)}")
    assert any(v > 0 for p in checked for v in fleet.lookups(p).values()), "nothing cached"
    assert scores(url, checked[0], fleet.tmp, fleet.seed_file) == fleet.lookups(checked[0])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("cluster")
    seed_file = tmp / "seed"
    seed_file.write_text(f"{SEED}\n")
    spec_file = tmp / "specs.json"
    spec_file.write_text(json.dumps(SPECS))
    engines = [
        Engine(f"e{i}", free_port(), seed_file, spec_file, tmp / "state" if i == 0 else None)
        for i in range(3)
    ]
    redis = RedisServer(tmp / "redis")
    nodes = [RedisServer(tmp / f"node{i}", cluster=True) for i in range(3)]
    fleet = Fleet(engines, redis, nodes, seed_file, tmp)
    try:
        redis.start()
        for node in nodes:
            node.start()
        create_cluster(nodes)
        for engine in engines:
            engine.start_server()
            engine.start_worker()
        for engine in engines:
            engine.wait_ready()
        # Two indexers on the same index: each source's lease picks its writer.
        fleet.start_indexer("indexer", redis.url)
        fleet.start_indexer("indexer-b", redis.url)
        fleet.start_indexer("cluster-indexer", nodes[0].url)
        yield fleet
    finally:
        for child in fleet.indexers.values():
            child.stop(5)
        for engine in engines:
            engine.stop()
        for server in [redis, *nodes]:
            server.stop()


def test_score_equals_every_engines_lookup(fleet: Fleet) -> None:
    prompts = fleet.traffic()
    assert_index_matches(fleet, fleet.redis.url, prompts)


def test_the_same_on_a_three_node_redis_cluster(fleet: Fleet) -> None:
    prompts = fleet.traffic()
    assert_index_matches(fleet, fleet.cluster_nodes[0].url, prompts)


@pytest.mark.slow
def test_the_index_follows_running_traffic_within_a_bounded_lag(fleet: Fleet) -> None:
    """Engines keep admitting while prompts are checked: each check passes within
    LAG_BOUND_S of traffic pausing for it (3 s of traffic; KVSVC_SLOW=1: 60 s)."""
    import threading

    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    scorer = Scorer(connect(fleet.redis.url), SEED)
    seconds = 60.0 if os.environ.get("KVSVC_SLOW") else 3.0
    deadline = time.monotonic() + seconds
    checks = 0
    while time.monotonic() < deadline:
        stop = threading.Event()
        made: list[list[int]] = []

        def drive(stop: threading.Event, made: list[list[int]]) -> None:
            while not stop.is_set():
                made.extend(fleet.traffic(2))

        driver = threading.Thread(target=drive, args=(stop, made))
        driver.start()
        time.sleep(0.5)
        stop.set()
        driver.join(30)
        paused = time.monotonic()
        prompt = made[-1]
        while scorer.score(prompt, max_registry_age=0).scores != fleet.lookups(prompt):
            assert time.monotonic() - paused < LAG_BOUND_S, "the index lags too far behind"
            time.sleep(0.02)
        checks += 1
    assert checks >= 2


def test_redis_restarted_empty_is_rebuilt(fleet: Fleet) -> None:
    from kvsvc.cluster.layout import Keys
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    # An indexer alone on its index (no standby to take over): what it finds when it
    # renews its lease is all that tells it Redis lost everything.
    engine = fleet.live()[0]
    solo = spawn(
        "solo-indexer",
        [
            "indexer", "--redis", fleet.redis.url, "--key-prefix", "solo", "--source",
            engine.source, "--metrics-listen", "off", "--lease-ttl", "1.5",
            "--log-level", "WARNING",
        ],
    )  # fmt: skip
    try:
        prompts = fleet.traffic(4)
        solo_scorer = Scorer(connect(fleet.redis.url), SEED, Keys("solo"))

        def solo_matches() -> bool:
            return all(
                solo_scorer.score(p, max_registry_age=0).scores
                == {engine.source: fleet.lookups(p)[engine.source]}
                for p in prompts
            )

        wait_for(solo_matches, what="the solo index")
        fleet.redis.restart()  # no persistence: everything is gone
        # Rebuilt without any new traffic, then followed again.
        wait_for(solo_matches, what="the solo index rebuilt without traffic")
        assert_index_matches(fleet, fleet.redis.url, prompts)
        assert_index_matches(fleet, fleet.redis.url, fleet.traffic())
    finally:
        solo.stop(5)


def metrics_of(child: Child) -> dict[str, float]:
    """The indexer's /metrics as {series: value}."""
    import urllib.request

    port = next(line for line in child.lines if "metrics on port" in line).split()[-1]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_the_indexers_share_the_sources_and_export_metrics(fleet: Fleet) -> None:
    assert_index_matches(fleet, fleet.redis.url, fleet.traffic(6))
    both = [metrics_of(fleet.indexers[name]) for name in ("indexer", "indexer-b")]
    writing = sum(m['kvsvc_indexer_sources{state="writing"}'] for m in both)
    standby = sum(m['kvsvc_indexer_sources{state="standby"}'] for m in both)
    assert (writing, standby) == (len(fleet.live()), len(fleet.live()))
    assert sum(m['kvsvc_indexer_events_total{kind="stored"}'] for m in both) > 0
    assert sum(m['kvsvc_indexer_snapshots_total{reason="new"}'] for m in both) >= 1
    for engine in fleet.live():
        lag = max(m.get(f'kvsvc_indexer_lag_seconds{{source="{engine.source}"}}', -1) for m in both)
        assert 0 <= lag < 10


def test_the_cluster_dashboard_queries_return_data_from_the_indexers(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A real Prometheus scrapes both indexers; every query of the cluster-index dashboard
    (deploy/grafana/kvsvc-cluster-index.json, ``$__rate_interval`` and the variables
    filled in as Grafana does) is valid PromQL and has data."""
    from tests.deploy.files import CLUSTER_DASHBOARD, require_tool
    from tests.observability.test_prometheus_e2e import RATE_INTERVAL, run_prometheus

    binary = require_tool("prometheus")
    ports = [
        next(line for line in child.lines if "metrics on port" in line).split()[-1]
        for child in (fleet.indexers["indexer"], fleet.indexers["indexer-b"])
    ]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "kvsvc-indexer",
                "static_configs": [{"targets": [f"127.0.0.1:{port}" for port in ports]}],
            }
        ],
    }
    with run_prometheus(binary, config, tmp_path) as api:
        api.wait_for('count_over_time(up{job="kvsvc-indexer"}[1m]) >= 6', "3 scrapes of both")
        fleet.traffic(2)  # events while Prometheus watches
        time.sleep(3)
        dashboard = json.loads(CLUSTER_DASHBOARD.read_text())
        exprs = [
            (panel["title"], target["expr"])
            for panel in dashboard["panels"]
            for target in panel.get("targets", [])
        ]
        assert exprs
        empty = []
        for title, expr in exprs:
            filled = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$instance", ".*")
            if not api.query(filled):  # fails on a PromQL error
                empty.append((title, expr))
        assert not empty, f"queries with no data: {empty}"


def test_a_killed_indexer_resumes_where_redis_says(fleet: Fleet) -> None:
    fleet.indexers["indexer"].process.kill()
    fleet.indexers.pop("indexer").stop(5)
    prompts = fleet.traffic()  # made while no indexer runs
    fleet.start_indexer("indexer", fleet.redis.url)
    assert_index_matches(fleet, fleet.redis.url, [*prompts, *fleet.traffic(4)])


def test_a_server_restarted_without_its_state_leaves_no_stale_entry(fleet: Fleet) -> None:
    engine = fleet.engines[1]
    before = fleet.traffic()
    assert any(fleet.lookups(p)[engine.source] for p in before)
    engine.stop_server(kill=True)
    fleet.held.pop(engine.name, None)
    engine.start_server()  # a new epoch, empty; its agent comes back by itself
    engine.wait_ready()
    assert all(fleet.lookups(p)[engine.source] == 0 for p in before)
    assert_index_matches(fleet, fleet.redis.url, before)
    assert_index_matches(fleet, fleet.redis.url, fleet.traffic())


def test_a_server_restarted_on_its_state_keeps_its_entries(fleet: Fleet) -> None:
    engine = fleet.engines[0]
    before = fleet.traffic()
    engine.stop_server()
    engine.start_server()
    engine.wait_ready()
    assert any(fleet.lookups(p)[engine.source] for p in before), "the state kept the cache"
    assert_index_matches(fleet, fleet.redis.url, [*before, *fleet.traffic(4)])


def test_a_server_gone_past_purge_after_is_purged(fleet: Fleet) -> None:
    engine = fleet.engines[2]
    fleet.traffic(4)
    engine.worker.stop(5)  # type: ignore[union-attr]
    engine.worker = None
    engine.stop_server(kill=True)
    time.sleep(3.5)  # --purge-after 3
    assert_index_matches(fleet, fleet.redis.url, fleet.traffic())
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    assert engine.source not in Scorer(connect(fleet.redis.url), SEED).score([1] * 40).scores


def test_the_router_serves_the_same_scores(fleet: Fleet) -> None:
    from kvsvc_client import InvalidArgumentError, UnauthenticatedError

    from kvsvc.cluster.router import ClusterIndexClient

    prompts = fleet.traffic(6)
    assert_index_matches(fleet, fleet.redis.url, prompts)
    token_file = fleet.tmp / "router-tokens"
    token_file.write_text("# routers\nrouter-token-0123456789\n")
    router = spawn(
        "router",
        [
            "router", "--redis", fleet.redis.url, "--listen", "127.0.0.1:0",
            "--hash-seed-file", str(fleet.seed_file), "--token-file", str(token_file),
        ],
    )  # fmt: skip
    try:
        wait_for(lambda: any("serving on port" in line for line in router.lines), what="router")
        port = next(line for line in router.lines if "serving on port" in line).split()[-1]
        with ClusterIndexClient(f"127.0.0.1:{port}", token="router-token-0123456789") as index:
            for prompt in [*prompts[:4], *SYSTEM_PROMPTS]:
                got = index.score(prompt)
                assert got == fleet.lookups(prompt)
                assert list(got.values()) == sorted(got.values(), reverse=True)
            some = fleet.engines[0].source
            assert index.score(SYSTEM_PROMPTS[0], engines=[some, "nobody:1/p"]) == {
                some: fleet.lookups(SYSTEM_PROMPTS[0])[some]
            }
            with pytest.raises(InvalidArgumentError, match="token_ids"):
                index.score([2**31 + 5] * 20)
        with (
            ClusterIndexClient(f"127.0.0.1:{port}", token="wrong-token-0123456789") as index,
            pytest.raises(UnauthenticatedError),
        ):
            index.score(SYSTEM_PROMPTS[0])
    finally:
        router.stop(5)


def test_a_sources_file_is_followed_while_it_changes(fleet: Fleet) -> None:
    from kvsvc.cluster.layout import Keys
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    live = fleet.live()
    sources = fleet.tmp / "sources.txt"
    sources.write_text(f"# the fleet\n{live[0].source}\n")
    indexer = spawn(
        "file-indexer",
        [
            "indexer", "--redis", fleet.redis.url, "--key-prefix", "filetest",
            "--sources-file", str(sources), "--metrics-listen", "off", "--log-level", "WARNING",
        ],
    )  # fmt: skip
    try:
        scorer = Scorer(connect(fleet.redis.url), SEED, Keys("filetest"))

        def listed() -> set[str]:
            return set(scorer.score(SYSTEM_PROMPTS[0], max_registry_age=0).scores)

        wait_for(lambda: listed() == {live[0].source}, what="the first source")
        sources.write_text(f"{live[-1].source}\n")  # one added, one removed (purged)
        wait_for(lambda: listed() == {live[-1].source}, what="the file's new sources")
        prompts = fleet.traffic(4)
        wait_for(
            lambda: all(
                scorer.score(p, max_registry_age=0).scores
                == {live[-1].source: fleet.lookups(p)[live[-1].source]}
                for p in prompts
            ),
            what="the new source's index",
        )
    finally:
        indexer.stop(5)


def test_the_router_over_tls_and_the_indexers_metrics_over_https(fleet: Fleet) -> None:
    import ssl
    import urllib.request

    from kvsvc_client import UnavailableError

    from kvsvc.cluster.router import ClusterIndexClient
    from kvsvc.tls import client_tls
    from kvsvc.tools.devcerts import find_openssl, make_dev_certs
    from tests.tooling import missing

    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    certs = make_dev_certs(fleet.tmp / "certs")
    router = spawn(
        "tls-router",
        [
            "router", "--redis", fleet.redis.url, "--listen", "127.0.0.1:0",
            "--hash-seed-file", str(fleet.seed_file),
            "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        ],
    )  # fmt: skip
    indexer = spawn(
        "https-indexer",
        [
            "indexer", "--redis", fleet.redis.url, "--key-prefix", "httpstest",
            "--source", fleet.live()[0].source, "--metrics-listen", "127.0.0.1:0",
            "--metrics-tls-cert", str(certs.server_cert),
            "--metrics-tls-key", str(certs.server_key), "--log-level", "WARNING",
        ],
    )  # fmt: skip
    try:
        wait_for(lambda: any("serving on port" in line for line in router.lines), what="router")
        port = next(line for line in router.lines if "serving on port" in line).split()[-1]
        prompt = SYSTEM_PROMPTS[1]
        tls = client_tls(str(certs.ca), None, None, None)
        with ClusterIndexClient(f"127.0.0.1:{port}", tls=tls) as index:
            assert index.score(prompt) == fleet.lookups(prompt)
        with (
            ClusterIndexClient(f"127.0.0.1:{port}", timeout=2) as plain,
            pytest.raises(UnavailableError),
        ):
            plain.score(prompt)  # plaintext to a TLS listener: refused
        wait_for(lambda: any("metrics on port" in line for line in indexer.lines), what="indexer")
        metrics_port = next(x for x in indexer.lines if "metrics on port" in x).split()[-1]
        context = ssl.create_default_context(cafile=str(certs.ca))
        url = f"https://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, context=context, timeout=5) as response:
            assert b"kvsvc_indexer_events_total" in response.read()
    finally:
        router.stop(5)
        indexer.stop(5)
