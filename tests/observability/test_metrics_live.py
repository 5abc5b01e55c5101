"""/metrics of a live server and a live worker agent after a known workload: every series
the issue lists, with exact values where the workload fixes them and the engine API's own
figures where the core decides (queries, evictions, cached blocks); names that follow
Prometheus' conventions, bounded labels, and ``promtool check metrics`` on both scrapes.
"""

from __future__ import annotations

import subprocess

import pytest

import kvsvc.native
from kvsvc.server.pool import PoolState
from tests.deploy.files import require_tool
from tests.observability.conftest import (
    BYTES_PER_BLOCK,
    USABLE_BLOCKS,
    LiveKvsvc,
)
from tests.observability.metric_names import (
    agent_metric_names,
    server_metric_names,
)
from tests.observability.promtext import label_sets, parse, value

# Labels a kvsvc series may carry: bounded sets only (STYLE.md, issue #5). The pool_info
# and agent_info series carry configuration values, which are bounded per deployment.
BOUNDED_LABELS = {
    "pool",
    "group",
    "kind",
    "rank",
    "method",
    "code",
    "state",
    "le",
    "generation",
    "outcome",
    "stage",
    "grpc_type",
    "grpc_service",
    "grpc_method",
    "grpc_code",
}
INFO_LABELS = {
    "kvsvc_build_info": {"version", "core"},
    "kvsvc_pool_info": {"pool", "model", "block_size", "hash_algo", "prefix_caching", "world_size"},
    "kvsvc_agent_info": {"pool", "rank", "device"},
}


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )


# ---------------------------------------------------------------- before any traffic


def test_a_fresh_server_exports_every_pool_series_at_zero(live: LiveKvsvc) -> None:
    samples = parse(live.fresh_scrape)
    for pool in ("p", "u", "w"):
        assert value(samples, "kvsvc_pool_state", pool=pool, state="WAITING_FOR_WORKERS") == 1
        for state in ("PLANNED", "READY", "DEGRADED"):
            assert value(samples, "kvsvc_pool_state", pool=pool, state=state) == 0
        for name, labels in (
            ("kvsvc_pool_blocks", {}),
            ("kvsvc_pool_free_blocks", {}),
            ("kvsvc_pool_used_blocks", {}),
            ("kvsvc_kv_cache_usage_ratio", {}),
            ("kvsvc_kv_cache_capacity_tokens", {}),
            ("kvsvc_pool_requests", {}),
            ("kvsvc_prefix_cache_blocks", {}),
            ("kvsvc_prefix_cache_queries_tokens_total", {"kind": "new"}),
            ("kvsvc_prefix_cache_queries_tokens_total", {"kind": "preempted"}),
            ("kvsvc_prefix_cache_hits_tokens_total", {"kind": "new"}),
            ("kvsvc_prefix_cache_hits_tokens_total", {"kind": "preempted"}),
            ("kvsvc_prefix_cache_evictions_total", {}),
            ("kvsvc_lookup_requests_total", {}),
            ("kvsvc_lookup_hit_tokens_total", {}),
            ("kvsvc_allocations_total", {"code": "ok"}),
            ("kvsvc_allocations_total", {"code": "no_space"}),
            ("kvsvc_blocks_allocated_total", {}),
            ("kvsvc_blocks_freed_total", {}),
            ("kvsvc_request_frees_total", {"kind": "finished"}),
            ("kvsvc_request_frees_total", {"kind": "preempted"}),
            ("kvsvc_events_published_total", {"kind": "stored"}),
            ("kvsvc_events_published_total", {"kind": "removed"}),
            ("kvsvc_events_published_total", {"kind": "cleared"}),
            ("kvsvc_event_batches_dropped_total", {}),
            ("kvsvc_event_subscribers", {}),
            ("kvsvc_workers_registered", {}),
            ("kvsvc_worker_allocation_reports_total", {}),
            ("kvsvc_step_operations_count", {}),
        ):
            assert value(samples, name, pool=pool, **labels) == 0, (name, pool, labels)
    # Every gRPC method shows up with code OK before its first call.
    methods = {s["grpc_method"] for s in label_sets(samples, "grpc_server_handled_total")}
    assert {"Allocate", "Free", "Step", "Lookup", "WatchEvents", "Register", "Heartbeat"} <= (
        methods
    )
    assert all(v == 0 for v in samples["grpc_server_handled_total"].values())


def test_every_family_the_code_declares_is_scraped(live: LiveKvsvc) -> None:
    scraped = set(parse(live.scrape()))
    declared = server_metric_names()
    # Everything declared shows up (per-rank series exist now that ranks registered) ...
    assert declared <= scraped, sorted(declared - scraped)
    # ... and nothing else but prometheus_client's _created timestamps.
    extra = {n for n in scraped - declared if not n.endswith("_created")}
    assert not extra, sorted(extra)


# ---------------------------------------------------------------- after the workload


def test_workload_counters_are_exact(live: LiveKvsvc) -> None:
    w = live.workload
    s = parse(live.scrape())
    assert value(s, "kvsvc_allocations_total", pool="p", code="ok") == w.allocations_ok
    assert value(s, "kvsvc_allocations_total", pool="p", code="no_space") == (
        w.allocations_no_space
    )
    assert value(s, "kvsvc_prefix_cache_hits_tokens_total", pool="p", kind="new") == w.hits_new
    assert value(s, "kvsvc_prefix_cache_hits_tokens_total", pool="p", kind="preempted") == (
        w.hits_preempted
    )
    assert value(s, "kvsvc_prefix_cache_queries_tokens_total", pool="p", kind="preempted") == (
        w.queries_preempted
    )
    assert value(s, "kvsvc_lookup_requests_total", pool="p") == w.lookups
    assert value(s, "kvsvc_lookup_hit_tokens_total", pool="p") == w.lookup_hit_tokens
    assert value(s, "kvsvc_request_frees_total", pool="p", kind="finished") == w.frees_finished
    assert value(s, "kvsvc_request_frees_total", pool="p", kind="preempted") == w.frees_preempted
    assert value(s, "kvsvc_blocks_allocated_total", pool="p") == w.blocks_allocated
    assert value(s, "kvsvc_blocks_freed_total", pool="p") == w.blocks_freed
    assert value(s, "kvsvc_events_published_total", pool="p", kind="stored") >= 1


def test_gauges_agree_with_the_engine_api(live: LiveKvsvc) -> None:
    usage = live.usage
    s = parse(live.scrape())
    assert value(s, "kvsvc_pool_blocks", pool="p") == usage.num_blocks == USABLE_BLOCKS
    assert value(s, "kvsvc_pool_free_blocks", pool="p") == usage.num_free_blocks == USABLE_BLOCKS
    assert value(s, "kvsvc_pool_used_blocks", pool="p") == 0
    assert value(s, "kvsvc_kv_cache_usage_ratio", pool="p") == usage.usage == 0
    assert value(s, "kvsvc_pool_requests", pool="p") == usage.num_requests == 0
    assert value(s, "kvsvc_kv_cache_capacity_tokens", pool="p") == usage.kv_cache_capacity_tokens
    assert value(s, "kvsvc_prefix_cache_blocks", pool="p") == usage.num_cached_blocks >= 2
    assert value(s, "kvsvc_prefix_cache_evictions_total", pool="p") == usage.num_evictions
    assert value(s, "kvsvc_prefix_cache_queries_tokens_total", pool="p", kind="new") == (
        usage.prefix_cache_queries
    )
    assert value(s, "kvsvc_prefix_cache_hits_tokens_total", pool="p", kind="new") == (
        usage.prefix_cache_hits
    )


def test_usage_ratio_excludes_the_null_block(live: LiveKvsvc) -> None:
    """Hold a request's blocks and read the ratio: used / usable, the null block left out."""
    from kvsvc_client import KVCacheClient

    with KVCacheClient(live.server.address, pool="u") as kv:
        kv.allocate("held", list(range(5000, 5048)), 48, start=True)  # 3 blocks
        try:
            s = parse(live.scrape())
            assert value(s, "kvsvc_pool_used_blocks", pool="u") == 3
            assert value(s, "kvsvc_pool_free_blocks", pool="u") == USABLE_BLOCKS - 3
            assert value(s, "kvsvc_pool_requests", pool="u") == 1
            assert value(s, "kvsvc_kv_cache_usage_ratio", pool="u") == 3 / USABLE_BLOCKS
        finally:
            kv.free("held")
    assert value(parse(live.scrape()), "kvsvc_pool_used_blocks", pool="u") == 0


def test_pool_info_and_state(live: LiveKvsvc) -> None:
    s = parse(live.scrape())
    (info,) = [labels for labels in label_sets(s, "kvsvc_pool_info") if labels["pool"] == "p"]
    assert info == {
        "pool": "p",
        "model": "test-model",
        "block_size": "16",
        "hash_algo": "xxh3_128",
        "prefix_caching": "true",
        "world_size": "1",
    }
    for pool in ("p", "u", "w"):
        states = {
            labels["state"]: v
            for labels, v in zip(
                label_sets(s, "kvsvc_pool_state"), s["kvsvc_pool_state"].values(), strict=True
            )
            if labels["pool"] == pool
        }
        assert states == {state.name: float(state == PoolState.READY) for state in PoolState}
    assert value(s, "kvsvc_build_info") == 1
    # The server runs this test's build of the core (it inherits KVSVC_PURE_PYTHON).
    (build,) = label_sets(s, "kvsvc_build_info")
    assert build["core"] == kvsvc.native.BUILD


def test_step_batch_size_histogram(live: LiveKvsvc) -> None:
    s = parse(live.scrape())
    assert value(s, "kvsvc_step_operations_count", pool="p") == live.workload.steps
    assert value(s, "kvsvc_step_operations_sum", pool="p") == live.workload.step_operations
    assert value(s, "kvsvc_step_operations_bucket", pool="p", le="1.0") == 0
    assert value(s, "kvsvc_step_operations_bucket", pool="p", le="2.0") == 1
    assert value(s, "kvsvc_step_operations_bucket", pool="p", le="+Inf") == 1


def test_grpc_series_follow_go_grpc_prometheus(live: LiveKvsvc) -> None:
    s = parse(live.scrape())
    service = "kvsvc.v1.KVCacheService"
    for method, calls in live.workload.grpc_ok:
        labels = {"grpc_service": service, "grpc_method": method, "grpc_type": "unary"}
        assert value(s, "grpc_server_handled_total", grpc_code="OK", **labels) >= calls, method
        handled = sum(
            v
            for k, v in s["grpc_server_handled_total"].items()
            if {("grpc_method", method), ("grpc_service", service)} <= k
        )
        assert value(s, "grpc_server_handling_seconds_count", **labels) == handled, method
        assert value(s, "grpc_server_handling_seconds_sum", **labels) > 0, method
    register = {"grpc_service": "kvsvc.v1.WorkerService", "grpc_method": "Register"}
    assert value(s, "grpc_server_handled_total", grpc_code="OK", **register) >= 1
    watch = {"grpc_method": "WatchPlan", "grpc_code": "OK"}
    assert value(s, "grpc_server_handled_total", grpc_type="server_stream", **watch) >= 0


def test_worker_series_on_the_server(live: LiveKvsvc) -> None:
    live.heartbeat()
    s = parse(live.scrape())
    kv_bytes = (USABLE_BLOCKS + 1) * BYTES_PER_BLOCK
    assert value(s, "kvsvc_workers_registered", pool="p") == 1
    assert 0 <= value(s, "kvsvc_worker_heartbeat_age_seconds", pool="p", rank="0") < 5
    assert value(s, "kvsvc_worker_memory_total_bytes", pool="p", rank="0") == 4 * kv_bytes
    assert value(s, "kvsvc_worker_kv_cache_offered_bytes", pool="p", rank="0") == kv_bytes
    assert value(s, "kvsvc_worker_memory_free_bytes", pool="p", rank="0") > 0
    assert value(s, "kvsvc_pool_planned_bytes", pool="p", rank="0") == kv_bytes
    assert value(s, "kvsvc_worker_allocation_reports_total", pool="p") == 1
    assert value(s, "kvsvc_worker_registrations_total", pool="p") == 1
    assert value(s, "kvsvc_plan_failures_total", pool="p") == 0


def test_agent_series_agree_with_the_server(live: LiveKvsvc) -> None:
    agent = parse(live.scrape_agent())
    server = parse(live.scrape())
    labels = {"pool": "w", "rank": "0"}
    assert value(agent, "kvsvc_agent_ready", **labels) == 1
    assert value(agent, "kvsvc_agent_info", device="cpu", **labels) == 1
    tensor_bytes = value(agent, "kvsvc_agent_tensor_bytes", **labels)
    assert tensor_bytes == value(server, "kvsvc_pool_planned_bytes", **labels) > 0
    assert value(agent, "kvsvc_agent_kv_cache_offered_bytes", **labels) == 16 << 20
    assert value(server, "kvsvc_worker_kv_cache_offered_bytes", **labels) == 16 << 20
    assert value(agent, "kvsvc_agent_device_memory_free_bytes", **labels) > 0
    assert value(server, "kvsvc_worker_memory_free_bytes", **labels) > 0
    assert value(agent, "kvsvc_agent_heartbeat_failures_total", **labels) == 0
    assert value(server, "kvsvc_workers_registered", pool="w") == 1
    assert set(agent) - {n for n in agent if n.endswith("_created")} == agent_metric_names()


@pytest.mark.parametrize("which", ["server", "agent"])
def test_labels_are_bounded(live: LiveKvsvc, which: str) -> None:
    s = parse(live.scrape() if which == "server" else live.scrape_agent())
    request_ids = {"a", "b", "c", "held"}
    for name, series in s.items():
        for labels in series:
            names = {k for k, _ in labels}
            allowed = INFO_LABELS.get(name, BOUNDED_LABELS)
            assert names <= allowed, f"{name}: unexpected labels {sorted(names - allowed)}"
            assert not {v for _, v in labels} & request_ids, f"{name}: a request id as a label"
        if name.startswith("kvsvc_"):
            pools = {dict(labels).get("pool") for labels in series} - {None}
            assert pools <= {"p", "u", "w"}, name


def test_names_follow_prometheus_conventions(live: LiveKvsvc) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for text in (live.scrape(), live.scrape_agent()):
        for family in text_string_to_metric_families(text):
            name = family.name
            if name.endswith("_created"):
                continue  # prometheus_client's creation timestamps of counters/histograms
            assert name.startswith(("kvsvc_", "grpc_server_")), name
            assert ":" not in name and name == name.lower(), name
            assert family.documentation, f"{name}: no HELP text"
            if family.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
            else:
                assert not name.endswith("_total"), name
            if "seconds" in name or "bytes" in name:
                assert name.endswith(("_seconds", "_bytes")), f"{name}: unit not last"
            assert not name.endswith(("_ms", "_milliseconds", "_kb", "_mb", "_percent")), name


def test_promtool_accepts_the_server_scrape(live: LiveKvsvc) -> None:
    result = promtool_check(live.scrape())
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


def test_promtool_accepts_the_agent_scrape(live: LiveKvsvc) -> None:
    result = promtool_check(live.scrape_agent())
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), (
        result.stdout + result.stderr
    )


def test_promtool_lint_can_fail() -> None:
    """The check is real: a counter without _total and a non-base unit are reported."""
    bad = "# HELP x_ms Latency.\n# TYPE x_ms counter\nx_ms 1\n"
    result = promtool_check(bad)
    assert result.returncode != 0
    assert "_total" in result.stdout + result.stderr
