"""deploy/compose.yaml and what it mounts: services, targets, commands, ports, provisioning.

No Docker engine here: the file is checked against the Dockerfile, the Prometheus config
and the Grafana provisioning it wires together; test_commands_live.py runs its commands.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvsvc.server.config import DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN
from tests.deploy.files import (
    AGENT_METRICS_PORT,
    COMPOSE,
    DASHBOARD,
    DEPLOY,
    GRAFANA,
    PROMETHEUS,
    dockerfile_stages,
    effective,
    flag_value,
    load_yaml,
    port_of,
)

GRPC_PORT = port_of(DEFAULT_LISTEN)
METRICS_PORT = port_of(DEFAULT_METRICS_LISTEN)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def published(service: dict[str, Any]) -> dict[int, int]:
    """Container port -> host port of ``ports:`` entries (``[ip:]host:container``)."""
    out = {}
    for entry in service.get("ports", []):
        *host, container = str(entry).split(":")
        out[int(container)] = int(host[-1])
    return out


def test_the_five_services(services: dict[str, Any]) -> None:
    assert set(services) == {"server", "worker", "engine", "prometheus", "grafana"}


def test_kvsvc_services_build_existing_targets(services: dict[str, Any]) -> None:
    stages = dockerfile_stages()
    for name, target in (("server", "server"), ("worker", "worker"), ("engine", "server")):
        build = services[name]["build"]
        assert build["target"] == target and target in stages
        context = (COMPOSE.parent / build["context"]).resolve()
        assert (context / build["dockerfile"]).is_file()
        assert services[name]["image"] == f"kvsvc:{target}"


def test_commands_are_the_image_defaults(services: dict[str, Any]) -> None:
    """The compose file writes the images' CMDs out; they must not drift apart."""
    stages = dockerfile_stages()
    for name in ("server", "worker"):
        assert services[name]["command"] == effective(stages, name, "CMD").exec_form()


def test_healthchecks_are_the_images(services: dict[str, Any]) -> None:
    stages = dockerfile_stages()
    for name in ("server", "worker"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        assert test[1:] == effective(stages, name, "HEALTHCHECK").exec_form()
    # The engine runs the server image but is no server: the inherited check is off.
    assert services["engine"]["healthcheck"] == {"disable": True}


def test_ports_agree_with_the_server_defaults(services: dict[str, Any]) -> None:
    server = services["server"]
    assert port_of(flag_value(server["command"], "--listen")) == GRPC_PORT
    assert port_of(flag_value(server["command"], "--metrics-listen")) == METRICS_PORT
    assert published(server) == {GRPC_PORT: GRPC_PORT, METRICS_PORT: METRICS_PORT}
    worker = services["worker"]
    assert port_of(flag_value(worker["command"], "--metrics-listen")) == AGENT_METRICS_PORT
    assert published(worker) == {AGENT_METRICS_PORT: AGENT_METRICS_PORT}
    # Worker and engine reach the server by its service name on the gRPC port.
    assert flag_value(worker["command"], "--server") == f"server:{GRPC_PORT}"
    assert flag_value(services["engine"]["command"], "--server") == f"server:{GRPC_PORT}"
    for service in services.values():
        for entry in service.get("ports", []):
            assert str(entry).startswith("127.0.0.1:"), f"{entry}: publish on loopback only"


def test_one_pool_name_everywhere(services: dict[str, Any]) -> None:
    pool = flag_value(services["server"]["command"], "--pool")
    assert flag_value(services["worker"]["command"], "--pool") == pool
    assert flag_value(services["engine"]["command"], "--pool") == pool
    world_size = int(flag_value(services["server"]["command"], "--world-size"))
    assert world_size == 1 and flag_value(services["worker"]["command"], "--rank") == "0"


def test_startup_order(services: dict[str, Any]) -> None:
    assert services["worker"]["depends_on"]["server"]["condition"] == "service_healthy"
    assert services["engine"]["depends_on"]["server"]["condition"] == "service_healthy"


def test_prometheus_scrapes_both_kvsvc_services(services: dict[str, Any]) -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert sorted(t for ts in targets.values() for t in ts) == sorted(
        [f"server:{METRICS_PORT}", f"worker:{AGENT_METRICS_PORT}"]
    )
    mounts = mounted(services["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS / "prometheus.yml"
    for rule_file in config["rule_files"]:
        assert mounts[f"/etc/prometheus/{rule_file}"] == PROMETHEUS / rule_file
    command = services["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


def mounted(service: dict[str, Any]) -> dict[str, Any]:
    """Container path -> repo path of bind mounts (``./x:/y[:ro]``)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        if source.startswith("."):
            path = (COMPOSE.parent / source).resolve()
            assert path.is_file(), f"{volume}: {path} does not exist"
            out[target] = path
    return out


def test_grafana_gets_the_dashboard_and_the_datasource(services: dict[str, Any]) -> None:
    mounts = mounted(services["grafana"])
    provider = load_yaml(GRAFANA / "dashboards.yaml")
    assert provider["apiVersion"] == 1
    (entry,) = provider["providers"]
    assert entry["type"] == "file"
    dashboard_dir = entry["options"]["path"]
    dashboards = [t for t, p in mounts.items() if p == DASHBOARD]
    assert len(dashboards) == 1 and dashboards[0].startswith(dashboard_dir + "/")
    assert any(
        t.startswith("/etc/grafana/provisioning/dashboards/") and p == GRAFANA / "dashboards.yaml"
        for t, p in mounts.items()
    )
    assert any(
        t.startswith("/etc/grafana/provisioning/datasources/") and p == GRAFANA / "datasources.yaml"
        for t, p in mounts.items()
    )
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == dashboards[0]
    datasources = load_yaml(GRAFANA / "datasources.yaml")["datasources"]
    assert [d["type"] for d in datasources] == ["prometheus"]
    assert datasources[0]["url"] == "http://prometheus:9090"
    assert published(services["prometheus"]) == {9090: 9090}


def test_deploy_yaml_files_all_parse() -> None:
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        assert load_yaml(path) is not None, path
