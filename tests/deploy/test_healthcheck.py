"""``python -m kvsvc.tools.healthcheck``: the container health check, against a real server
on loopback and a real agent metrics endpoint.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvsvc.server.app import KVCACHE_SERVICE, pool_health_name
from kvsvc.server.config import PoolConfig
from kvsvc.tools.healthcheck import check_agent, check_grpc, main
from tests.server.harness import ServerThread, bring_up, running_server
from tests.tooling import free_port, missing


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    ready = PoolConfig(name="ready", world_size=1, max_model_len=256)
    waiting = PoolConfig(name="waiting", world_size=2, max_model_len=256)
    with running_server(ready, waiting, heartbeat_timeout_s=600) as srv:
        ranks = bring_up(srv, "ready")
        yield srv
        for rank in ranks:
            rank.close()


def test_the_server_itself_is_serving(server: ServerThread) -> None:
    result = check_grpc(server.address)
    assert result.healthy, result.message
    assert "SERVING" in result.message


def test_a_ready_pool_serves_and_a_waiting_one_does_not(server: ServerThread) -> None:
    assert check_grpc(server.address, pool_health_name("ready")).healthy
    waiting = check_grpc(server.address, pool_health_name("waiting"))
    assert not waiting.healthy and "NOT_SERVING" in waiting.message
    # All pools together: not while one waits for its workers.
    assert not check_grpc(server.address, KVCACHE_SERVICE).healthy


def test_an_unknown_service_name_is_unhealthy_and_says_so(server: ServerThread) -> None:
    result = check_grpc(server.address, "kvsvc.v1.KVCacheService/nope")
    assert not result.healthy
    assert "unknown health service 'kvsvc.v1.KVCacheService/nope'" in result.message


def test_nothing_listening_is_unhealthy_within_the_timeout() -> None:
    result = check_grpc(f"127.0.0.1:{free_port()}", timeout=0.5)
    assert not result.healthy
    assert "UNAVAILABLE" in result.message or "DEADLINE_EXCEEDED" in result.message


def test_exit_status_is_what_docker_reads(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--server", server.address]) == 0
    assert main(["--server", server.address, "--service", pool_health_name("waiting")]) == 1
    assert "NOT_SERVING" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([], "--server"),
        (["--server", "no-port"], "--server"),
        (["--server", "127.0.0.1:0"], "--server"),
        (["--server", "127.0.0.1:50051", "--agent-metrics", "127.0.0.1:9401"], "--agent-metrics"),
        (["--agent-metrics", "127.0.0.1:9401", "--service", "x"], "--service"),
        (["--server", "127.0.0.1:50051", "--timeout", "0"], "--timeout"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_agent_readiness_from_its_metrics() -> None:
    pytest.importorskip("torch", reason="kvsvc.worker imports torch (the worker extra)")
    from kvsvc.worker.metrics import AgentMetrics, serve_metrics

    metrics = AgentMetrics("p", 0, "cpu")
    endpoint = serve_metrics("127.0.0.1:0", metrics.registry)
    try:
        address = f"127.0.0.1:{endpoint.port}"
        waiting = check_agent(address)
        assert not waiting.healthy and "not ready" in waiting.message
        metrics.ready.set(1)
        assert check_agent(address).healthy
        assert main(["--agent-metrics", address]) == 0
    finally:
        endpoint.close()


def test_a_metrics_endpoint_of_something_else_is_not_an_agent(server: ServerThread) -> None:
    pytest.importorskip("torch", reason="kvsvc.worker imports torch (the worker extra)")
    from prometheus_client import CollectorRegistry

    from kvsvc.worker.metrics import serve_metrics

    endpoint = serve_metrics("127.0.0.1:0", CollectorRegistry())
    try:
        result = check_agent(f"127.0.0.1:{endpoint.port}")
        assert not result.healthy and "no kvsvc_agent_ready" in result.message
    finally:
        endpoint.close()
    assert not check_agent(f"127.0.0.1:{free_port()}", timeout=0.5).healthy


def test_runs_as_a_module(server: ServerThread) -> None:
    """The exact command line of the Dockerfile's HEALTHCHECK, with this server's port."""
    ok = subprocess.run(
        [sys.executable, "-m", "kvsvc.tools.healthcheck", "--server", server.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "kvsvc.tools.healthcheck", "--server", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stderr.strip()


# ---------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from kvsvc.tools.devcerts import find_openssl, make_dev_certs

    if find_openssl() is None:
        missing("the openssl command line", "apt-get install openssl")
    root = tmp_path_factory.mktemp("certs")
    return make_dev_certs(root / "good"), make_dev_certs(root / "other")


@pytest.fixture(scope="module")
def mtls_server(certs: Any) -> Iterator[ServerThread]:
    good, _ = certs
    with running_server(
        PoolConfig(name="p", world_size=1, max_model_len=256),
        tls_cert=str(good.server_cert),
        tls_key=str(good.server_key),
        tls_client_ca=str(good.ca),
    ) as srv:
        yield srv


@pytest.fixture
def no_tls_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("KVSVC_TLS_CA", "KVSVC_TLS_CERT", "KVSVC_TLS_KEY", "KVSVC_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KVSVC_METRICS_TLS_CERT", raising=False)
    return monkeypatch


def test_tls_flags_and_environment_reach_an_mtls_server(
    mtls_server: ServerThread, certs: Any, no_tls_env: pytest.MonkeyPatch
) -> None:
    good, other = certs
    flags = ["--tls-ca", str(good.ca), "--tls-cert", str(good.client_cert)]
    flags += ["--tls-key", str(good.client_key)]
    assert main(["--server", mtls_server.address, "--timeout", "2", *flags]) == 0
    # The container way: the variables its kvsvc process already has.
    no_tls_env.setenv("KVSVC_TLS_CA", str(good.ca))
    no_tls_env.setenv("KVSVC_TLS_CERT", str(good.client_cert))
    no_tls_env.setenv("KVSVC_TLS_KEY", str(good.client_key))
    assert main(["--server", mtls_server.address, "--timeout", "2"]) == 0
    # Without a client certificate, or with one of another CA: unhealthy.
    assert main(["--server", mtls_server.address, "--timeout", "2", "--tls-cert", ""]) == 2
    no_tls_env.delenv("KVSVC_TLS_CERT")
    no_tls_env.delenv("KVSVC_TLS_KEY")
    assert main(["--server", mtls_server.address, "--timeout", "2"]) == 1
    foreign = ["--tls-cert", str(other.client_cert), "--tls-key", str(other.client_key)]
    assert main(["--server", mtls_server.address, "--timeout", "2", *foreign]) == 1


def test_a_plaintext_check_of_a_tls_server_is_unhealthy(
    mtls_server: ServerThread, no_tls_env: pytest.MonkeyPatch
) -> None:
    result = check_grpc(mtls_server.address, timeout=1.0)
    assert not result.healthy and "UNAVAILABLE" in result.message


def test_a_missing_tls_file_is_one_line_and_unhealthy(
    server: ServerThread, no_tls_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--server", server.address, "--tls-ca", "/nonexistent/ca.crt"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "tls_ca: cannot read /nonexistent/ca.crt: No such file or directory"
    ]


def test_agent_metrics_over_https(certs: Any, no_tls_env: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch", reason="kvsvc.worker imports torch (the worker extra)")
    from kvsvc.tls import ClientTls, ServerTls
    from kvsvc.worker.metrics import AgentMetrics, serve_metrics

    good, other = certs
    metrics = AgentMetrics("p", 0, "cpu")
    metrics.ready.set(1)
    endpoint = serve_metrics(
        "127.0.0.1:0",
        metrics.registry,
        tls=ServerTls(str(good.server_cert), str(good.server_key), str(good.ca)),
    )
    try:
        address = f"127.0.0.1:{endpoint.port}"
        client = ClientTls(str(good.ca), str(good.client_cert), str(good.client_key))
        assert check_agent(address, tls=client, https=True).healthy
        # Connected by IP, checked against a name on the certificate.
        named = ClientTls(client.ca, client.cert, client.key, server_name="localhost")
        assert check_agent(address, tls=named, https=True).healthy
        wrong = ClientTls(client.ca, client.cert, client.key, server_name="wrong.test")
        assert not check_agent(address, tls=wrong, https=True).healthy
        assert not check_agent(address, tls=ClientTls(str(good.ca)), https=True).healthy
        assert not check_agent(address, tls=ClientTls(str(other.ca)), https=True).healthy
        assert not check_agent(address, timeout=1.0).healthy  # plain HTTP
        flags = ["--tls-ca", str(good.ca), "--tls-cert", str(good.client_cert)]
        flags += ["--tls-key", str(good.client_key)]
        assert main(["--agent-metrics", f"https://{address}", *flags]) == 0
        # A bare address: HTTP, unless the container says its agent serves HTTPS.
        assert main(["--agent-metrics", address, *flags]) == 1
        no_tls_env.setenv("KVSVC_METRICS_TLS_CERT", str(good.server_cert))
        assert main(["--agent-metrics", address, *flags]) == 0
        assert main(["--agent-metrics", f"http://{address}", *flags]) == 1
    finally:
        endpoint.close()
