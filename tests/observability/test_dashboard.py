"""The Grafana dashboard: stable uid, the datasource and pool variables, the rows the issue
asks for, every panel on the ``datasource`` variable, and no query of a metric kvsvc does
not export (checked against the server's and the agent's registries).

tests/observability/test_prometheus_e2e.py runs every one of these queries on a real
Prometheus that scraped a live server and agent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deploy.files import CLUSTER_DASHBOARD, DASHBOARD
from tests.observability.metric_names import (
    agent_metric_names,
    exported_metric_names,
    promql_metric_names,
    server_metric_names,
    server_wide_metric_names,
    unknown_metric_names,
)

UID = "kvsvc-overview"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROWS = (
    "Capacity and usage",
    "Prefix cache",
    "Allocation",
    "Latency",
    "Event stream",
    "Workers",
)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested (collapsed) panels included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(panel title, expr)`` of every query, the variables' ones included."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield f"${variable['name']}", query["query"] if isinstance(query, dict) else query


def variable_query_expr(query: str) -> str:
    """The PromQL inside Grafana's ``label_values(expr, label)``."""
    assert query.startswith("label_values(") and query.endswith(")"), query
    return query[len("label_values(") : query.rindex(",")]


def test_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == UID  # links and provisioning depend on it: never change it
    assert dashboard["title"] and "kvsvc" in dashboard["tags"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert "id" not in dashboard or dashboard["id"] is None


def test_datasource_and_pool_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    pool = variables["pool"]
    assert pool["type"] == "query" and pool["datasource"] == DATASOURCE
    assert "label_values(kvsvc_pool_info" in pool["query"]["query"]
    assert pool["query"]["query"].endswith(", pool)")
    assert pool["includeAll"] and pool["multi"] and pool["allValue"] == ".*"
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]


def test_rows_in_order(dashboard: dict[str, Any]) -> None:
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert len(rows) == len(ROWS)
    for row, expected in zip(rows, ROWS, strict=True):
        assert row.startswith(expected), (row, expected)


def test_every_panel_queries_through_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    for panel in panels(dashboard):
        if panel["type"] == "row":
            assert not panel.get("targets"), panel["title"]
            continue
        assert panel.get("datasource") == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_panels_query_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    known = exported_metric_names()
    for title, expr in queries(dashboard):
        if title.startswith("$"):
            expr = variable_query_expr(expr)
        unknown = unknown_metric_names(expr, known)
        assert not unknown, f"panel {title!r} queries {sorted(unknown)}, not exported"


def test_pool_series_are_filtered_by_the_pool_variable(dashboard: dict[str, Any]) -> None:
    # A series of the whole server process (build info, the handler stages: timed across
    # pools, as gRPC's latency is) has no pool label for a panel to filter by.
    pool_labelled = {
        n for n in exported_metric_names() if n.startswith("kvsvc_")
    } - server_wide_metric_names()
    for title, expr in queries(dashboard):
        if title.startswith("$"):
            continue
        if promql_metric_names(expr) & pool_labelled:
            assert 'pool=~"$pool"' in expr, f"panel {title!r} ignores the pool variable"


def test_server_wide_series_are_the_process_ones() -> None:
    # What the pool-variable check above exempts: the process's own series, never a pool's.
    server_wide = server_wide_metric_names()
    assert {"kvsvc_build_info", "kvsvc_handler_stage_seconds_total"} <= server_wide
    assert not server_wide & {"kvsvc_kv_cache_usage_ratio", "kvsvc_pool_blocks"}


def test_the_dashboard_covers_the_issue_series(dashboard: dict[str, Any]) -> None:
    used = set().union(*(promql_metric_names(e) for _, e in queries(dashboard)))
    for name in (
        "kvsvc_kv_cache_usage_ratio",
        "kvsvc_kv_cache_capacity_tokens",
        "kvsvc_prefix_cache_hits_tokens_total",
        "kvsvc_prefix_cache_queries_tokens_total",
        "kvsvc_allocations_total",
        "kvsvc_step_operations_bucket",
        "grpc_server_handling_seconds_bucket",
        "grpc_server_handled_total",
        "kvsvc_events_published_total",
        "kvsvc_event_subscribers",
        "kvsvc_event_batches_dropped_total",
        "kvsvc_worker_heartbeat_age_seconds",
        "kvsvc_worker_memory_free_bytes",
        "kvsvc_agent_tensor_bytes",
        "kvsvc_handler_stage_seconds_total",
    ):
        assert name in used, f"no panel shows {name}"
    latency = [e for _, e in queries(dashboard) if "grpc_server_handling_seconds_bucket" in e]
    for method in ("Step", "Allocate"):
        assert any(f'grpc_method="{method}"' in e and "histogram_quantile" in e for e in latency)


def test_layout_is_sane(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert grid["h"] > 0 and grid["y"] >= 0, panel["title"]
        assert panel["type"] in ("row", "timeseries", "stat"), panel["type"]
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
            assert target["refId"]


def test_metric_name_extraction() -> None:
    """The checker itself: it finds metric names and nothing else, so a typo fails."""
    expr = (
        "histogram_quantile(0.99, sum by (instance, le) (rate(grpc_server_handling_seconds_bucket{"
        'instance=~"$instance", grpc_method="Step"}[$__rate_interval])))'
        " / on (pool) group_left (model) kvsvc_pool_info > bool 0.5"
    )
    assert promql_metric_names(expr) == {"grpc_server_handling_seconds_bucket", "kvsvc_pool_info"}
    assert promql_metric_names('sum without (kind) (kvsvc_x_total{a="b"}) or vector(0)') == {
        "kvsvc_x_total"
    }
    known = exported_metric_names()
    assert unknown_metric_names("rate(kvsvc_prefix_cache_hit_total[5m])", known) == {
        "kvsvc_prefix_cache_hit_total"
    }
    assert not unknown_metric_names("rate(kvsvc_step_operations_count[5m])", known)


def test_exported_names_come_from_both_registries() -> None:
    server, agent = server_metric_names(), agent_metric_names()
    assert {"kvsvc_pool_info", "grpc_server_handled_total", "kvsvc_step_operations_bucket"} <= (
        server
    )
    assert {"kvsvc_agent_tensor_bytes", "kvsvc_agent_device_memory_free_bytes"} <= agent
    assert not server & agent


def test_the_cluster_index_dashboard(dashboard: dict[str, Any]) -> None:
    """deploy/grafana/kvsvc-cluster-index.json: its own uid, the same datasource variable,
    an indexer filter on every query, and only series the indexer exports
    (tests/cluster runs its queries on a real Prometheus scraping real indexers)."""
    from kvsvc.cluster.metrics import IndexerMetrics
    from tests.observability.metric_names import sample_names

    cluster = json.loads(CLUSTER_DASHBOARD.read_text())
    assert cluster["uid"] == "kvsvc-cluster-index" != dashboard["uid"]
    assert "kvsvc" in cluster["tags"]
    variables = {v["name"]: v for v in cluster["templating"]["list"]}
    assert variables["datasource"] == next(
        v for v in dashboard["templating"]["list"] if v["name"] == "datasource"
    )
    known = frozenset(sample_names(IndexerMetrics().registry))
    seen = set()
    for title, expr in queries(cluster):
        if title.startswith("$"):
            expr = variable_query_expr(expr)
        else:
            assert 'instance=~"$instance"' in expr, title
        unknown = unknown_metric_names(expr, known)
        assert not unknown, f"panel {title!r} queries {sorted(unknown)}, not exported"
        seen |= promql_metric_names(expr)
    for panel in panels(cluster):
        if panel["type"] != "row":
            assert panel.get("datasource") == DATASOURCE, panel["title"]
    # Lag per source, events/s, snapshots, Redis errors: the issue's series.
    for name in (
        "kvsvc_indexer_lag_seconds",
        "kvsvc_indexer_events_total",
        "kvsvc_indexer_snapshots_total",
        "kvsvc_indexer_redis_errors_total",
    ):
        assert name in seen, name
