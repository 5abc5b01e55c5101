"""The Prometheus artefacts through Prometheus' own tool: the alert rules are valid and
behave as their unit tests say, the compose scrape config is valid, and every rule reads
only metrics kvsvc exports.

promtool comes with the Debian package ``prometheus`` (.ci/run installs it); without it
these tests skip, saying so, and fail in CI (:mod:`tests.tooling`).
"""

from __future__ import annotations

import subprocess

from tests.deploy.files import PROMETHEUS, load_yaml, require_tool
from tests.observability.metric_names import exported_metric_names, unknown_metric_names

ALERTS = PROMETHEUS / "alerts.yml"
# The alerts the deployment promises (issue #5), and two for a pool that never gets ready.
EXPECTED_ALERTS = {
    "KvsvcPoolDegraded",
    "KvsvcPoolNotReady",
    "KvsvcPlanFailing",
    "KvsvcKVCacheUsageHigh",
    "KvsvcAllocateNoSpace",
    "KvsvcWorkerHeartbeatLost",
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROMETHEUS,
    )


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in result.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_checks_the_compose_scrape_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_promised_alerts_exist_with_severity_and_text() -> None:
    rules = [r for g in load_yaml(ALERTS)["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == EXPECTED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert "for" in rule, f"{rule['alert']}: a blip must not page"
    by_name = {r["alert"]: r for r in rules}
    assert by_name["KvsvcKVCacheUsageHigh"]["for"] == "5m"
    assert "0.95" in by_name["KvsvcKVCacheUsageHigh"]["expr"]
    assert 'state="DEGRADED"' in by_name["KvsvcPoolDegraded"]["expr"]
    assert 'code="no_space"' in by_name["KvsvcAllocateNoSpace"]["expr"]


def test_rules_read_only_exported_metrics() -> None:
    known = exported_metric_names()
    for group in load_yaml(ALERTS)["groups"]:
        for rule in group["rules"]:
            assert not unknown_metric_names(rule["expr"], known), rule["alert"]


def test_the_unit_tests_cover_every_alert() -> None:
    tested = {
        case["alertname"]
        for test in load_yaml(PROMETHEUS / "alerts_test.yml")["tests"]
        for case in test["alert_rule_test"]
    }
    assert tested == EXPECTED_ALERTS
