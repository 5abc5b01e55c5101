"""The TLS variants of the deployment: deploy/kubernetes-tls/ (a kustomize overlay of
deploy/kubernetes/) and deploy/compose.tls.yaml (layered over deploy/compose.yaml).

Statically: every TLS flag and ``KVSVC_TLS_*`` path points into a mounted certificate
(a Secret key in Kubernetes, the ``KVSVC_TLS_DIR`` bind mount in compose), the listeners
use the server certificate and every client the client one, no kubelet gRPC probe is left
(they cannot speak TLS), Prometheus scrapes HTTPS with the client certificate, and the
overlay's commands are the base's plus the TLS flags (so the two cannot drift apart). The
overlay's JSON patches are applied here in Python (no kubectl needed) and, when kubectl is
installed, checked equal to what ``kubectl kustomize`` renders.

Live (e2e): the TLS commands run as processes on loopback with throwaway certificates in
place of the mounts: health checks, the agent, the engine and a scrape all speak mTLS, and
a plaintext health check of the same server fails.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from kvsvc.demo.processes import Child, spawn, stop_all
from kvsvc.ports import is_unix_address
from kvsvc.server.app import pool_health_name
from kvsvc.server.config import DEFAULT_LISTEN
from tests.deploy.files import (
    COMPOSE,
    DEPLOY,
    KUBERNETES,
    PROMETHEUS,
    dockerfile_stages,
    effective,
    flag_value,
    kubernetes_documents,
    load_yaml,
    load_yaml_documents,
    port_of,
    rewrite_flag,
    rewrite_listen,
)
from tests.tooling import missing, require_tool

OVERLAY = DEPLOY / "kubernetes-tls"
COMPOSE_TLS = DEPLOY / "compose.tls.yaml"
PROMETHEUS_TLS = PROMETHEUS / "prometheus-tls.yml"
HEALTHCHECK = ["python", "-m", "kvsvc.tools.healthcheck"]
SERVER_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca")
CLIENT_ENV = ("KVSVC_TLS_CA", "KVSVC_TLS_CERT", "KVSVC_TLS_KEY")
METRICS_ENV = ("KVSVC_METRICS_TLS_CERT", "KVSVC_METRICS_TLS_KEY", "KVSVC_METRICS_TLS_CLIENT_CA")
ALL_TLS_ENV = (*CLIENT_ENV, "KVSVC_TLS_SERVER_NAME", *METRICS_ENV)
# What each setting must be: (Secret, key) in Kubernetes (cert-manager's layout).
SERVER_SECRET, CLIENT_SECRET = "kvsvc-server-tls", "kvsvc-client-tls"
TOKENS_SECRET = "kvsvc-tokens"
ROLES = ("engine", "agent", "admin")
K8S_SERVER_FILES = {
    "--tls-cert": (SERVER_SECRET, "tls.crt"),
    "--tls-key": (SERVER_SECRET, "tls.key"),
    "--tls-client-ca": (SERVER_SECRET, "ca.crt"),
}
K8S_CLIENT_ENV = {
    "KVSVC_TLS_CA": (CLIENT_SECRET, "ca.crt"),
    "KVSVC_TLS_CERT": (CLIENT_SECRET, "tls.crt"),
    "KVSVC_TLS_KEY": (CLIENT_SECRET, "tls.key"),
}
K8S_METRICS_ENV = {
    "KVSVC_METRICS_TLS_CERT": (SERVER_SECRET, "tls.crt"),
    "KVSVC_METRICS_TLS_KEY": (SERVER_SECRET, "tls.key"),
    "KVSVC_METRICS_TLS_CLIENT_CA": (SERVER_SECRET, "ca.crt"),
}
# ... and the file of KVSVC_TLS_DIR (kvsvc.tools.devcerts' names) in compose.
COMPOSE_SERVER_FILES = {"--tls-cert": "server.crt", "--tls-key": "server.key"}
COMPOSE_SERVER_FILES["--tls-client-ca"] = "ca.crt"
COMPOSE_CLIENT_ENV = {"KVSVC_TLS_CA": "ca.crt", "KVSVC_TLS_CERT": "client.crt"}
COMPOSE_CLIENT_ENV["KVSVC_TLS_KEY"] = "client.key"
COMPOSE_METRICS_ENV = {"KVSVC_METRICS_TLS_CERT": "server.crt"}
COMPOSE_METRICS_ENV["KVSVC_METRICS_TLS_KEY"] = "server.key"
COMPOSE_METRICS_ENV["KVSVC_METRICS_TLS_CLIENT_CA"] = "ca.crt"


# ---------------------------------------------------------------- JSON patch (RFC 6902)


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_json_patch(document: Any, operations: list[dict[str, Any]]) -> Any:
    """``document`` with ``add``/``replace``/``remove`` applied (what the overlay uses)."""
    doc = copy.deepcopy(document)
    for op in operations:
        *parents, last = _pointer(op["path"])
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        kind = op["op"]
        assert kind in ("add", "replace", "remove"), f"unsupported op {kind}"
        if isinstance(target, list):
            if kind == "add":
                index = len(target) if last == "-" else int(last)
                target.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                target[int(last)] = copy.deepcopy(op["value"])
            else:
                del target[int(last)]
        else:
            if kind == "replace" or kind == "remove":
                assert last in target, f"{kind} {op['path']}: nothing there"
            if kind == "remove":
                del target[last]
            else:
                target[last] = copy.deepcopy(op["value"])
    return doc


def overlay() -> dict[str, Any]:
    return load_yaml(OVERLAY / "kustomization.yaml")


def overlay_documents() -> list[dict[str, Any]]:
    """The base's manifests with the overlay's patches applied (kustomize's job)."""
    kustomization = overlay()
    assert kustomization["resources"] == ["../kubernetes"]
    docs = [copy.deepcopy(doc) for _, doc in kubernetes_documents()]
    for patch in kustomization["patches"]:
        target = patch["target"]
        ops = load_yaml(OVERLAY / patch["path"])
        matched = [
            i
            for i, doc in enumerate(docs)
            if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]
        ]
        assert len(matched) == 1, f"{patch['path']}: {len(matched)} targets"
        docs[matched[0]] = apply_json_patch(docs[matched[0]], ops)
    return docs


def find(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment")["spec"]["template"]["spec"]


def containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    spec = pod(docs)
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def secret_file(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """The (Secret, key) that ``path`` is inside ``container`` of pod ``spec``."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container.get("volumeMounts", []):
        directory = PurePosixPath(mount["mountPath"])
        if PurePosixPath(path).parent == directory:
            volume = volumes[mount["name"]]
            assert "secret" in volume, f"{path}: volume {mount['name']} is not a Secret"
            assert mount.get("readOnly") is True, f"{mount['name']} must be read-only"
            assert "items" not in volume["secret"], "keys are mounted under their own names"
            return volume["secret"]["secretName"], PurePosixPath(path).name
    raise AssertionError(f"{container['name']}: {path} is on no mounted volume")


# ---------------------------------------------------------------- Kubernetes overlay


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return overlay_documents()


def test_the_overlay_renders_offline_as_patched_here(docs: list[dict[str, Any]]) -> None:
    kubectl = require_tool("kubectl", "kubectl kustomize renders the overlay")
    result = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    yaml = pytest.importorskip("yaml")
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    # Undo what the base kustomization itself adds (its label and image names).
    base = load_yaml(KUBERNETES / "kustomization.yaml")
    labels = {k for entry in base.get("labels", []) for k in entry["pairs"]}
    images = {f"{i['newName']}:{i['newTag']}": i["name"] for i in base.get("images", [])}
    for doc in rendered:
        for key in labels:
            doc["metadata"].get("labels", {}).pop(key, None)
        if doc["kind"] == "Deployment":
            for c in containers([doc]).values():
                c["image"] = images.get(c["image"], c["image"])

    def key(d: dict[str, Any]) -> str:
        return d["kind"]

    assert sorted(rendered, key=key) == sorted(docs, key=key)


def test_the_overlay_only_adds_to_the_base_commands(docs: list[dict[str, Any]]) -> None:
    base = containers([doc for _, doc in kubernetes_documents()])
    tls = containers(docs)
    assert base.keys() == tls.keys()
    for name, container in tls.items():
        before = base[name].get("args", [])
        assert container["args"][: len(before)] == before, name
        assert container.get("command") == base[name].get("command"), name
        assert container["image"] == base[name]["image"], name
    sidecar_extra = tls["kvsvc"]["args"][len(base["kvsvc"]["args"]) :]
    assert sidecar_extra[0::2] == [*SERVER_FLAGS, *(f"--{role}-token-file" for role in ROLES)]
    for name in ("worker", "engine"):
        assert tls[name]["args"] == base[name]["args"], f"{name}: TLS comes from its env"


def test_the_sidecar_serves_mtls_with_the_server_secret(docs: list[dict[str, Any]]) -> None:
    sidecar = containers(docs)["kvsvc"]
    for flag, expected in K8S_SERVER_FILES.items():
        assert secret_file(pod(docs), sidecar, flag_value(sidecar["args"], flag)) == expected


def test_each_role_reads_its_token_file_from_the_tokens_secret(
    docs: list[dict[str, Any]],
) -> None:
    spec, c = pod(docs), containers(docs)
    for role in ROLES:
        path = flag_value(c["kvsvc"]["args"], f"--{role}-token-file")
        assert secret_file(spec, c["kvsvc"], path) == (TOKENS_SECRET, role)
    for name, role in (("worker", "agent"), ("engine", "engine")):
        env = env_of(c[name])
        assert secret_file(spec, c[name], env[f"KVSVC_{role.upper()}_TOKEN_FILE"]) == (
            TOKENS_SECRET,
            role,
        )
        assert not any(k.endswith("_TOKEN") for k in env), "tokens come from files"


def test_every_client_presents_the_client_secret(docs: list[dict[str, Any]]) -> None:
    spec = pod(docs)
    for name, container in containers(docs).items():
        env = env_of(container)
        for variable, expected in K8S_CLIENT_ENV.items():
            assert secret_file(spec, container, env[variable]) == expected, (name, variable)
    worker = containers(docs)["worker"]
    for variable, expected in K8S_METRICS_ENV.items():
        assert secret_file(spec, worker, env_of(worker)[variable]) == expected, variable
    for volume in spec["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["defaultMode"] == 0o440, volume["name"]


def test_no_grpc_probe_is_left_and_the_exec_probes_ask_the_same_services(
    docs: list[dict[str, Any]],
) -> None:
    """Kubelet's gRPC probes speak plaintext only; the health check speaks TLS."""
    base = containers([doc for _, doc in kubernetes_documents()])["kvsvc"]
    sidecar = containers(docs)["kvsvc"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        argv = sidecar[probe]["exec"]["command"]
        assert "grpc" not in sidecar[probe]
        assert argv[:3] == HEALTHCHECK
        assert port_of(flag_value(argv, "--server")) == base[probe]["grpc"]["port"]
        service = flag_value(argv, "--service") if "--service" in argv else ""
        assert service == base[probe]["grpc"]["service"], probe
        assert sidecar[probe]["timeoutSeconds"] >= 3, "a Python start takes a while"
    # The worker's probe is still the image's HEALTHCHECK (its env makes it HTTPS).
    worker = containers(docs)["worker"]
    assert worker["readinessProbe"]["exec"]["command"] == (
        effective(dockerfile_stages(), "worker", "HEALTHCHECK").exec_form()
    )


def test_prometheus_scrapes_https_with_the_client_secret(docs: list[dict[str, Any]]) -> None:
    monitor = find(docs, "ServiceMonitor")
    assert len(monitor["spec"]["endpoints"]) == 2
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["scheme"] == "https"
        tls = endpoint["tlsConfig"]
        assert tls["serverName"] == find(docs, "Service")["metadata"]["name"]
        assert tls["ca"]["secret"] == {"name": CLIENT_SECRET, "key": "ca.crt"}
        assert tls["cert"]["secret"] == {"name": CLIENT_SECRET, "key": "tls.crt"}
        assert tls["keySecret"] == {"name": CLIENT_SECRET, "key": "tls.key"}
    (grpc_port,) = [p for p in find(docs, "Service")["spec"]["ports"] if p["name"] == "grpc"]
    assert "appProtocol" not in grpc_port, "kubernetes.io/h2c is cleartext HTTP/2"


# ---------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose_tls() -> dict[str, Any]:
    return load_yaml(COMPOSE_TLS)["services"]


def tls_mount(service: dict[str, Any]) -> str:
    """The container directory of the service's KVSVC_TLS_DIR bind mount (read-only)."""
    (volume,) = [v for v in service["volumes"] if v.startswith("${KVSVC_TLS_DIR:?")]
    *_, target, mode = volume.split(":")
    assert mode == "ro", volume
    return str(target)


def test_compose_tls_layers_over_the_base(compose_tls: dict[str, Any]) -> None:
    base = load_yaml(COMPOSE)["services"]
    assert set(compose_tls) <= set(base)
    server = compose_tls["server"]["command"]
    extra = server[len(base["server"]["command"]) :]
    assert server[: len(base["server"]["command"])] == base["server"]["command"]
    assert extra[0::2] == list(SERVER_FLAGS)
    for name in ("worker", "engine"):
        assert "command" not in compose_tls[name], f"{name}: TLS comes from its env"
        assert "healthcheck" not in compose_tls[name]


def test_compose_tls_paths_are_in_the_mounted_directory(compose_tls: dict[str, Any]) -> None:
    server = compose_tls["server"]
    where = tls_mount(server)
    for flag, name in COMPOSE_SERVER_FILES.items():
        assert flag_value(server["command"], flag) == f"{where}/{name}"
    for name in ("server", "worker", "engine"):
        service = compose_tls[name]
        env = service["environment"]
        for variable, file in COMPOSE_CLIENT_ENV.items():
            assert env[variable] == f"{tls_mount(service)}/{file}", (name, variable)
    worker = compose_tls["worker"]
    for variable, file in COMPOSE_METRICS_ENV.items():
        assert worker["environment"][variable] == f"{tls_mount(worker)}/{file}"


def test_compose_prometheus_uses_the_tls_config(compose_tls: dict[str, Any]) -> None:
    prometheus = compose_tls["prometheus"]
    assert (
        "./prometheus/prometheus-tls.yml:/etc/prometheus/prometheus.yml:ro"
        in (prometheus["volumes"])
    )
    where = tls_mount(prometheus)
    plain, tls = load_yaml(PROMETHEUS / "prometheus.yml"), load_yaml(PROMETHEUS_TLS)
    for job in tls["scrape_configs"]:
        assert job.pop("scheme") == "https"
        files = job.pop("tls_config")
        assert files == {
            "ca_file": f"{where}/ca.crt",
            "cert_file": f"{where}/client.crt",
            "key_file": f"{where}/client.key",
        }
    assert tls == plain, "prometheus-tls.yml is prometheus.yml plus TLS, nothing else"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvsvc.tools.devcerts import find_openssl, make_dev_certs

    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    return make_dev_certs(tmp_path_factory.mktemp("certs") / "dev")


def test_promtool_accepts_the_tls_config(certs: Any, tmp_path: Path) -> None:
    promtool = require_tool("promtool", "Debian package 'prometheus': apt-get install prometheus")
    text = PROMETHEUS_TLS.read_text().replace("/etc/prometheus/tls", str(certs.directory))
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copyfile(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    result = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- live


@dataclass(frozen=True)
class TlsScenario:
    """A TLS deployment's commands and environments, container paths already mapped."""

    server: list[str]
    server_env: dict[str, str]
    worker: list[str]
    worker_env: dict[str, str]
    engine: list[str]
    engine_env: dict[str, str]
    server_healthcheck: list[str]
    agent_healthcheck: list[str]
    readiness_service: str


def _mapped(value: str, mounts: dict[str, Path]) -> str:
    for directory, local in mounts.items():
        if value.startswith(directory + "/"):
            return str(local / value[len(directory) + 1 :])
    return value


def _map_all(values: list[str], mounts: dict[str, Path]) -> list[str]:
    return [_mapped(v, mounts) for v in values]


def _map_env(env: dict[str, str], mounts: dict[str, Path]) -> dict[str, str]:
    return {k: _mapped(v, mounts) for k, v in env.items()}


def _token_files(directory: Path) -> dict[str, Path]:
    """One token file per role, as ``kubectl create secret ... kvsvc-tokens`` would hold."""
    directory.mkdir(exist_ok=True)
    files = {}
    for role in ROLES:
        files[role] = directory / role
        files[role].write_text(f"{role}-token-{'0123456789abcdef' * 2}\n")
    return files


def kubernetes_tls_scenario(certs: Any, root: Path) -> TlsScenario:
    """Each Secret as a directory of its keys, where the pod would mount it."""
    secrets = {
        SERVER_SECRET: {
            "tls.crt": certs.server_cert,
            "tls.key": certs.server_key,
            "ca.crt": certs.ca,
        },
        CLIENT_SECRET: {
            "tls.crt": certs.client_cert,
            "tls.key": certs.client_key,
            "ca.crt": certs.ca,
        },
        TOKENS_SECRET: _token_files(root / "token-sources"),
    }
    docs = overlay_documents()
    spec = pod(docs)
    volumes = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    mounts: dict[str, Path] = {}
    for container in containers(docs).values():
        for mount in container.get("volumeMounts", []):
            if mount["name"] in volumes:
                local = root / volumes[mount["name"]]
                local.mkdir(exist_ok=True)
                for key, source in secrets[volumes[mount["name"]]].items():
                    shutil.copyfile(source, local / key)
                mounts[mount["mountPath"]] = local
    c = containers(docs)
    stages = dockerfile_stages()
    from tests.deploy.test_commands_live import engine_script_path

    return TlsScenario(
        server=_map_all(c["kvsvc"]["args"], mounts),
        server_env=_map_env(env_of(c["kvsvc"]), mounts),
        worker=_map_all(c["worker"]["args"], mounts),
        worker_env=_map_env(env_of(c["worker"]), mounts),
        engine=engine_script_path([*c["engine"]["command"], *c["engine"]["args"]]),
        engine_env=_map_env(env_of(c["engine"]), mounts),
        server_healthcheck=c["kvsvc"]["livenessProbe"]["exec"]["command"],
        agent_healthcheck=effective(stages, "worker", "HEALTHCHECK").exec_form(),
        readiness_service=flag_value(c["kvsvc"]["readinessProbe"]["exec"]["command"], "--service"),
    )


def compose_tls_scenario(certs: Any, root: Path) -> TlsScenario:
    """KVSVC_TLS_DIR is the devcerts directory itself."""
    base = load_yaml(COMPOSE)["services"]
    tls = load_yaml(COMPOSE_TLS)["services"]
    from tests.deploy.test_commands_live import engine_script_path

    def mounts(name: str) -> dict[str, Path]:
        return {tls_mount(tls[name]): Path(certs.directory)}

    engine = base["engine"]
    return TlsScenario(
        server=_map_all(tls["server"]["command"], mounts("server")),
        server_env=_map_env(tls["server"]["environment"], mounts("server")),
        worker=base["worker"]["command"],
        worker_env=_map_env(tls["worker"]["environment"], mounts("worker")),
        engine=engine_script_path([*engine["entrypoint"], *engine["command"]]),
        engine_env=_map_env(tls["engine"]["environment"], mounts("engine")),
        server_healthcheck=base["server"]["healthcheck"]["test"][1:],
        agent_healthcheck=base["worker"]["healthcheck"]["test"][1:],
        readiness_service=pool_health_name(flag_value(base["server"]["command"], "--pool")),
    )


_SERVING = re.compile(r"^kvsvc serving on port (\d+)(?:, metrics on port (\d+))?$")
_AGENT_METRICS = re.compile(r"metrics on https://[^\s:]+:(\d+)/metrics")


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in ALL_TLS_ENV}, **extra}


def _run(argv: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    assert argv[0] == "python", argv
    command = [sys.executable, *argv[1:]]
    return subprocess.run(command, capture_output=True, text=True, env=_clean_env(env), **kwargs)


def _wait(predicate: Callable[[], object], timeout: float, what: str, child: Child) -> None:
    from tests.deploy.test_commands_live import wait_until

    wait_until(predicate, timeout, what, child)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    stop_all(started)


@pytest.mark.e2e
@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="the worker agent needs torch (the worker extra)",
)
@pytest.mark.parametrize(
    "make", [kubernetes_tls_scenario, compose_tls_scenario], ids=lambda f: f.__name__
)
def test_tls_deployment_commands_run_over_mtls(
    make: Callable[[Any, Path], TlsScenario],
    certs: Any,
    tmp_path: Path,
    children: list[Child],
) -> None:
    s = make(certs, tmp_path)
    socket = str(tmp_path / "kvsvc.sock")
    frames_socket = str(tmp_path / "frames.sock")
    server_argv = rewrite_listen(s.server, socket, frames_socket)
    server_argv = rewrite_flag(server_argv, "--metrics-listen", "127.0.0.1:0")
    server = spawn("server", server_argv, env=_clean_env({}))
    children.append(server)
    found: list[tuple[int, int]] = []

    def serving() -> bool:
        for line in list(server.lines):
            if match := _SERVING.match(line):
                found.append((int(match.group(1)), int(match.group(2) or 0)))
                return True
        return False

    _wait(serving, 30, "the server to listen", server)
    port, metrics_port = found[0]
    tcp_address = f"127.0.0.1:{port}"
    # The engine's and the agent's address: the socket where the manifest gives one (TLS
    # over the Unix socket too; gRPC checks the certificate for "localhost" there).
    address = f"unix:{socket}" if is_unix_address(flag_value(s.worker, "--server")) else tcp_address

    def health(env: dict[str, str], service: str | None = None) -> int:
        argv = rewrite_flag(s.server_healthcheck, "--server", tcp_address)
        if service is not None:
            argv = rewrite_flag(argv, "--service", service) if "--service" in argv else argv
            argv = argv if "--service" in argv else [*argv, "--service", service]
        return _run(argv, env, timeout=60).returncode

    assert health(s.server_env) == 0
    assert health({}) == 1, "a plaintext health check of an mTLS server must fail"
    assert health(s.server_env, s.readiness_service) == 1  # no worker yet

    worker_argv = rewrite_flag(s.worker, "--server", address)
    worker_argv = rewrite_flag(worker_argv, "--metrics-listen", "127.0.0.1:0")
    worker = spawn("worker", worker_argv, env=_clean_env(s.worker_env))
    children.append(worker)
    _wait(lambda: _AGENT_METRICS.search(worker.output()), 60, "the agent's metrics", worker)
    match = _AGENT_METRICS.search(worker.output())
    assert match is not None
    agent = f"127.0.0.1:{match.group(1)}"
    agent_check = rewrite_flag(s.agent_healthcheck, "--agent-metrics", agent)
    _wait(
        lambda: _run(agent_check, s.worker_env, timeout=60).returncode == 0,
        60,
        "the agent's HTTPS health check",
        worker,
    )
    _wait(
        lambda: health(s.server_env, s.readiness_service) == 0, 30, "the pool's readiness", server
    )

    # The engine takes the framed socket where the manifest gives it one (plaintext: its
    # TLS settings are for TCP targets; the socket's directory guards it).
    engine_address = address
    if flag_value(s.engine, "--server").startswith("frames:unix:"):
        engine_address = f"frames:unix:{frames_socket}"
    engine_argv = rewrite_flag(s.engine, "--server", engine_address)
    engine_argv += ["--rounds", "1", "--requests", "20", "--step-interval", "0"]
    engine = _run(engine_argv, s.engine_env, timeout=120, cwd=Path(__file__).parents[2])
    assert engine.returncode == 0, engine.stdout + engine.stderr
    assert "workload 1: 20 requests" in engine.stdout, engine.stdout

    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    url = f"https://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        text = response.read().decode()
    pool = flag_value(s.server, "--pool")
    ok = re.search(rf'kvsvc_allocations_total\{{code="ok",pool="{pool}"\}} (\S+)', text)
    assert ok and float(ok.group(1)) >= 20, "the engine's allocations reached the server"

    assert worker.stop(grace=10) == 0, worker.output()
    assert server.stop(grace=10) == 0, server.output()


def test_the_tls_artefacts_parse_and_name_real_ports() -> None:
    for path in (*sorted(OVERLAY.glob("*.yaml")), COMPOSE_TLS, PROMETHEUS_TLS):
        assert load_yaml_documents(path), path
    grpc_port = port_of(DEFAULT_LISTEN)
    sidecar = containers(overlay_documents())["kvsvc"]
    assert port_of(flag_value(sidecar["startupProbe"]["exec"]["command"], "--server")) == grpc_port
    assert json.dumps(overlay())  # plain data: no YAML-only types in the kustomization
