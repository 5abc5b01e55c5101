"""A real Prometheus scrapes a live kvsvc server and worker agent; the test asks it, through
its HTTP query API, what arrived.

Prometheus runs on loopback with the deployment's own scrape config
(deploy/prometheus/prometheus.yml: the compose service addresses swapped for the live
ones, intervals shortened to 1 s) and the deployment's alert rules. After a few scrapes the
test checks the workload's series with their labels and values, joins the agent's and the
server's series, runs every query of the Grafana dashboard, and checks every alert rule
evaluates without error.

Prometheus comes with the Debian package ``prometheus`` (.ci/run installs it); without it
the test skips, saying so, and fails in CI (:mod:`tests.tooling`).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvsvc.server.config import DEFAULT_METRICS_LISTEN
from tests.deploy.files import (
    AGENT_METRICS_PORT,
    DASHBOARD,
    PROMETHEUS,
    load_yaml,
    port_of,
    require_tool,
)
from tests.observability.conftest import LiveKvsvc
from tests.observability.metric_names import agent_metric_names, promql_metric_names
from tests.tooling import free_port

pytestmark = pytest.mark.e2e

SCRAPES_BEFORE_CHECKS = 3
# What Grafana's $__rate_interval becomes for a 1 s scrape interval (4 x the interval),
# with room for a late scrape.
RATE_INTERVAL = "10s"


class PrometheusAPI:
    """The few endpoints of Prometheus' HTTP API the test uses."""

    def __init__(self, base: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.base = base
        self.process = process
        self.log = log

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 400/422: a bad query, with Prometheus' reason
            body = json.loads(exc.read())
        return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector; fails with Prometheus' error for a bad one."""
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        assert body["data"]["resultType"] == "vector", expr
        return list(body["data"]["result"])

    def scalar(self, expr: str) -> float:
        (sample,) = self.query(expr)
        return float(sample["value"][1])

    def wait_for(self, expr: str, what: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log.read_text()}"
            try:
                result = self.query(expr)
            except (OSError, AssertionError):
                result = []
            if result:
                return result
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what} ({expr}):\n{self.log.read_text()}")


def scrape_config(live: LiveKvsvc, rule_file: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml aimed at the live processes, scraping every 1 s."""
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    config["global"] = {
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "evaluation_interval": "1s",
    }
    config["rule_files"] = [str(rule_file)]
    server = f"server:{port_of(DEFAULT_METRICS_LISTEN)}"
    live_targets = {server: f"127.0.0.1:{live.metrics_port}"}
    if live.agent_metrics_port is not None:
        live_targets[f"worker:{AGENT_METRICS_PORT}"] = f"127.0.0.1:{live.agent_metrics_port}"
    jobs = []
    for job in config["scrape_configs"]:
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        if all(t in live_targets for t in targets):
            job["static_configs"] = [{"targets": [live_targets[t] for t in targets]}]
            jobs.append(job)
    config["scrape_configs"] = jobs
    return config


@pytest.fixture(scope="module")
def prometheus(
    live: LiveKvsvc, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PrometheusAPI]:
    binary = require_tool("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = scrape_config(live, PROMETHEUS / "alerts.yml")
    expected_jobs = {"kvsvc-server"} | ({"kvsvc-worker"} if live.agent else set())
    assert {job["job_name"] for job in config["scrape_configs"]} == expected_jobs
    live.heartbeat()
    with run_prometheus(binary, config, workdir) as api:
        for job in expected_jobs:
            api.wait_for(
                f'count_over_time(up{{job="{job}"}}[1m]) >= {SCRAPES_BEFORE_CHECKS}',
                f"{SCRAPES_BEFORE_CHECKS} scrapes of {job}",
            )
            assert api.scalar(f'up{{job="{job}"}}') == 1, f"{job} is down"
        yield api


@contextmanager
def run_prometheus(binary: str, config: dict[str, Any], workdir: Path) -> Iterator[PrometheusAPI]:
    """A Prometheus on a free loopback port with ``config`` (its data and log in
    ``workdir``), stopped after the block."""
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        yield PrometheusAPI(f"http://127.0.0.1:{port}", process, log)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def by_label(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    return {sample["metric"][label]: float(sample["value"][1]) for sample in result}


def test_workload_series_arrive_with_labels_and_values(
    live: LiveKvsvc, prometheus: PrometheusAPI
) -> None:
    w = live.workload
    instance = f"127.0.0.1:{live.metrics_port}"
    hits = prometheus.query('kvsvc_prefix_cache_hits_tokens_total{pool="p"}')
    assert by_label(hits, "kind") == {"new": w.hits_new, "preempted": w.hits_preempted}
    for sample in hits:
        assert sample["metric"]["job"] == "kvsvc-server"
        assert sample["metric"]["instance"] == instance
        assert sample["metric"]["__name__"] == "kvsvc_prefix_cache_hits_tokens_total"
    allocations = prometheus.query('kvsvc_allocations_total{pool="p"}')
    assert by_label(allocations, "code") == {
        "ok": w.allocations_ok,
        "no_space": w.allocations_no_space,
    }
    frees = prometheus.query('kvsvc_request_frees_total{pool="p"}')
    assert by_label(frees, "kind") == {"finished": w.frees_finished, "preempted": w.frees_preempted}
    assert prometheus.scalar('kvsvc_lookup_hit_tokens_total{pool="p"}') == w.lookup_hit_tokens
    # The dashboard's hit rate: new-request hits over new-request queries.
    rate = prometheus.scalar(
        'sum(kvsvc_prefix_cache_hits_tokens_total{pool="p", kind="new"})'
        ' / sum(kvsvc_prefix_cache_queries_tokens_total{pool="p", kind="new"})'
    )
    assert rate == pytest.approx(live.usage.hit_rate)
    (info,) = prometheus.query('kvsvc_pool_info{pool="p"}')
    assert {k: info["metric"][k] for k in ("model", "block_size", "hash_algo")} == {
        "model": "test-model",
        "block_size": "16",
        "hash_algo": "xxh3_128",
    }
    ready = prometheus.query('kvsvc_pool_state{state="READY"} == 1')
    assert sorted(s["metric"]["pool"] for s in ready) == ["p", "u", "w"]
    step = prometheus.query(
        'grpc_server_handled_total{grpc_service="kvsvc.v1.KVCacheService", grpc_code="OK"}'
    )
    handled = by_label(step, "grpc_method")
    for method, calls in w.grpc_ok:
        assert handled[method] >= calls, method


def test_agent_and_server_series_join(live: LiveKvsvc, prometheus: PrometheusAPI) -> None:
    if live.agent is None:
        pytest.skip(live.agent_skip_reason)
    (ready,) = prometheus.query('kvsvc_agent_ready{pool="w"}')
    assert ready["metric"]["job"] == "kvsvc-worker" and float(ready["value"][1]) == 1
    # The agent's tensors are exactly what the server planned for that rank.
    (diff,) = prometheus.query(
        'kvsvc_agent_tensor_bytes{pool="w"} - on (pool, rank) kvsvc_pool_planned_bytes{pool="w"}'
    )
    assert float(diff["value"][1]) == 0
    assert prometheus.scalar('kvsvc_agent_tensor_bytes{pool="w"}') > 0


def substitute(expr: str, pool: str = ".*") -> str:
    """Grafana's variables as the dashboard's 'All' selection would expand them."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return re.sub(
        r"\$\{?(instance|pool)\}?", lambda m: ".*" if m.group(1) == "instance" else pool, expr
    )


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = query[len("label_values(") : query.rindex(",")]
            out.append((f"${variable['name']}", inner))
    return out


def test_every_dashboard_query_runs_and_returns_data(
    live: LiveKvsvc, prometheus: PrometheusAPI
) -> None:
    agent_only = agent_metric_names()
    empty = []
    for title, expr in dashboard_queries():
        if live.agent is None and promql_metric_names(expr) & agent_only:
            continue
        result = prometheus.query(substitute(expr))  # fails on a PromQL error
        if not result:
            empty.append((title, expr))
    assert not empty, f"queries with no data after a workload: {empty}"


def test_dashboard_pool_filter_selects_one_pool(prometheus: PrometheusAPI) -> None:
    for title, expr in dashboard_queries():
        if title == "KV cache usage":
            result = prometheus.query(substitute(expr, pool="w"))
            assert [s["metric"]["pool"] for s in result] == ["w"]
            return
    raise AssertionError("no 'KV cache usage' panel")


def test_alert_rules_load_and_evaluate(prometheus: PrometheusAPI) -> None:
    expected = {
        r["alert"] for g in load_yaml(PROMETHEUS / "alerts.yml")["groups"] for r in g["rules"]
    }
    deadline = time.monotonic() + 20
    while True:
        groups = prometheus.get("/api/v1/rules", type="alert")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        evaluated = all(not r["lastEvaluation"].startswith("0001-") for r in rules)
        if rules and evaluated:
            break
        assert time.monotonic() < deadline, f"rules not evaluated: {rules}"
        time.sleep(0.2)
    assert {r["name"] for r in rules} == expected
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
    # Nothing is wrong with this deployment: no alert fires.
    firing = [a for r in rules for a in r.get("alerts", []) if a["state"] == "firing"]
    assert not firing, firing
