"""deploy/kubernetes/: the fields Kubernetes requires, the native sidecar and its gRPC probes
(on health names the server really registers), ports and selectors that line up, and the
PrometheusRule equal to the Prometheus rule file.

No cluster here; ``kubectl kustomize`` renders the kustomization offline (without kubectl
the test skips, and fails in CI: :mod:`tests.tooling`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import PurePosixPath
from typing import Any

import pytest

from kvsvc.ports import is_unix_address, unix_path
from kvsvc.server.app import KVCACHE_SERVICE, pool_health_name
from kvsvc.server.config import DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN
from tests.deploy.files import (
    AGENT_METRICS_PORT,
    KUBERNETES,
    PROMETHEUS,
    dockerfile_stages,
    effective,
    find_kind,
    flag_value,
    flag_values,
    kubernetes_documents,
    load_yaml,
    port_of,
)
from tests.tooling import require_tool

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# IANA service name: what a container/service port name must be.
PORT_NAME = re.compile(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PROBE_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")


def deployment() -> dict[str, Any]:
    (found,) = find_kind("Deployment")
    return found


def pod_spec() -> dict[str, Any]:
    return deployment()["spec"]["template"]["spec"]


def sidecar() -> dict[str, Any]:
    (found,) = [c for c in pod_spec()["initContainers"] if c["name"] == "kvsvc"]
    return found


def all_containers() -> list[dict[str, Any]]:
    spec = pod_spec()
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_kustomization_lists_every_manifest() -> None:
    kustomization = load_yaml(KUBERNETES / "kustomization.yaml")
    listed = set(kustomization["resources"])
    present = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    kinds = sorted(doc["kind"] for _, doc in kubernetes_documents())
    assert kinds == ["Deployment", "PrometheusRule", "Service", "ServiceMonitor"]


def test_every_object_has_the_required_fields() -> None:
    for path, doc in kubernetes_documents():
        where = f"{path.name} {doc.get('kind')}"
        assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], where
        assert isinstance(doc.get("kind"), str) and doc["kind"], where
        name = doc["metadata"]["name"]
        assert DNS_SUBDOMAIN.fullmatch(name) and len(name) <= 253, f"{where}: name {name!r}"
        for key, value in doc["metadata"].get("labels", {}).items():
            assert isinstance(value, str) and len(value) <= 63, f"{where}: label {key}"
        assert "spec" in doc, where
    assert deployment()["apiVersion"] == "apps/v1"
    (service,) = find_kind("Service")
    assert service["apiVersion"] == "v1"
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (found,) = find_kind(kind)
        assert found["apiVersion"] == "monitoring.coreos.com/v1"


def test_pod_template_is_valid() -> None:
    spec = deployment()["spec"]
    selector = spec["selector"]["matchLabels"]
    assert selector and selector.items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["template"]["spec"]["containers"], "a pod needs at least one container"
    names = [c["name"] for c in all_containers()]
    assert len(set(names)) == len(names), f"duplicate container names: {names}"
    port_names: list[str] = []
    for container in all_containers():
        assert DNS_LABEL.fullmatch(container["name"]), container["name"]
        assert isinstance(container.get("image"), str) and container["image"]
        args = [*container.get("command", []), *container.get("args", [])]
        assert all(isinstance(a, str) for a in args), f"{container['name']}: quote numbers"
        for port in container.get("ports", []):
            assert isinstance(port["containerPort"], int) and 0 < port["containerPort"] < 65536
            assert PORT_NAME.fullmatch(port["name"]) and len(port["name"]) <= 15, port["name"]
            assert port.get("protocol", "TCP") in ("TCP", "UDP", "SCTP")
            port_names.append(port["name"])
        for probe_name in PROBES:
            probe = container.get(probe_name)
            if probe is not None:
                handlers = [h for h in PROBE_HANDLERS if h in probe]
                assert len(handlers) == 1, f"{container['name']}.{probe_name}: {handlers}"
        context = container.get("securityContext", {})
        assert context.get("allowPrivilegeEscalation") is False, container["name"]
    assert len(set(port_names)) == len(port_names), f"duplicate port names: {port_names}"
    security = pod_spec()["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001


def test_kvsvc_is_a_native_sidecar_with_grpc_health_probes() -> None:
    container = sidecar()
    assert container["restartPolicy"] == "Always"
    grpc_port = port_of(DEFAULT_LISTEN)
    for probe_name in PROBES:
        probe = container[probe_name]
        assert probe["grpc"]["port"] == grpc_port, probe_name
        assert "service" in probe["grpc"], f"{probe_name}: name the health service"
    # Startup and liveness: the server process; readiness: the pool serves engine calls.
    assert container["startupProbe"]["grpc"]["service"] == ""
    assert container["livenessProbe"]["grpc"]["service"] == ""
    pool = flag_value(container["args"], "--pool")
    assert container["readinessProbe"]["grpc"]["service"] == pool_health_name(pool)


def test_probe_services_are_names_the_server_registers() -> None:
    """The names must match kvsvc.server.app's: an unknown name never becomes SERVING."""
    container = sidecar()
    pool = flag_value(container["args"], "--pool")
    registered = {"", KVCACHE_SERVICE, pool_health_name(pool)}
    for probe_name in PROBES:
        assert container[probe_name]["grpc"]["service"] in registered


def test_ports_agree_with_the_server_and_the_images() -> None:
    stages = dockerfile_stages()
    container = sidecar()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": port_of(DEFAULT_LISTEN), "metrics": port_of(DEFAULT_METRICS_LISTEN)}
    tcp, unix = flag_values(container["args"], "--listen")
    assert port_of(tcp) == ports["grpc"]
    assert port_of(flag_value(container["args"], "--metrics-listen")) == ports["metrics"]
    server_cmd = effective(stages, "server", "CMD").exec_form()
    assert port_of(flag_value(server_cmd, "--listen")) == ports["grpc"]
    (worker,) = [c for c in pod_spec()["containers"] if c["name"] == "worker"]
    assert worker["ports"] == [
        {"name": "worker-metrics", "containerPort": AGENT_METRICS_PORT, "protocol": "TCP"}
    ]
    assert port_of(flag_value(worker["args"], "--metrics-listen")) == AGENT_METRICS_PORT
    # The engine and the agent reach the sidecar over its Unix sockets, in an emptyDir that
    # the sidecar and each of them mount at the same place.
    assert is_unix_address(unix)
    directory = PurePosixPath(unix_path(unix)).parent
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}

    def socket_volume(container: dict[str, Any]) -> str:
        (name,) = [
            m["name"]
            for m in container.get("volumeMounts", [])
            if PurePosixPath(m["mountPath"]) == directory
        ]
        assert "emptyDir" in volumes[name], f"{name}: the socket's directory is an emptyDir"
        return name

    shared = socket_volume(sidecar())
    # The engine's scheduler takes the framed transport's socket, in the same directory.
    (frames,) = flag_values(container["args"], "--frames-listen")
    assert is_unix_address(frames) and PurePosixPath(unix_path(frames)).parent == directory
    expected = {"worker": unix, "engine": f"frames:{frames}"}
    for container in pod_spec()["containers"]:
        assert flag_value(container["args"], "--server") == expected[container["name"]]
        assert socket_volume(container) == shared, container["name"]
        assert flag_value(container["args"], "--pool") == flag_value(sidecar()["args"], "--pool")


def test_worker_probe_is_the_images_healthcheck() -> None:
    stages = dockerfile_stages()
    (worker,) = [c for c in pod_spec()["containers"] if c["name"] == "worker"]
    assert worker["readinessProbe"]["exec"]["command"] == (
        effective(stages, "worker", "HEALTHCHECK").exec_form()
    )
    assert worker["args"][0] == "worker" and sidecar()["args"][0] == "serve"


def test_service_selects_the_pod_and_names_its_ports() -> None:
    (service,) = find_kind("Service")
    template_labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= template_labels.items()
    container_ports = {
        p["name"]: p["containerPort"] for c in all_containers() for p in c.get("ports", [])
    }
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports, port
        assert port["port"] == container_ports[port["targetPort"]]
        assert PORT_NAME.fullmatch(port["name"])


def test_servicemonitor_scrapes_both_metrics_ports() -> None:
    (service,) = find_kind("Service")
    (monitor,) = find_kind("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    endpoints = [e["port"] for e in monitor["spec"]["endpoints"]]
    assert sorted(endpoints) == ["metrics", "worker-metrics"]
    assert set(endpoints) <= service_ports
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["path"] == "/metrics"


def test_prometheusrule_carries_the_rule_file() -> None:
    (rule,) = find_kind("PrometheusRule")
    assert rule["spec"]["groups"] == load_yaml(PROMETHEUS / "alerts.yml")["groups"]


def test_kustomize_renders_offline() -> None:
    kubectl = require_tool(
        "kubectl",
        "kubectl kustomize renders the kustomization (the machine image's apt package "
        "'kubectl'; apt-get install kubectl where its repository is configured)",
    )
    result = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    yaml = pytest.importorskip("yaml")
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    assert sorted(d["kind"] for d in rendered) == [
        "Deployment",
        "PrometheusRule",
        "Service",
        "ServiceMonitor",
    ]
    images = {
        c["image"]
        for d in rendered
        if d["kind"] == "Deployment"
        for c in [
            *d["spec"]["template"]["spec"]["initContainers"],
            *d["spec"]["template"]["spec"]["containers"],
        ]
    }
    assert all("/" in image and ":" in image for image in images), images
