"""``python -m kvsvc.tools.healthcheck``: the container health check, against a real server
on loopback and a real agent metrics endpoint.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvsvc.server.app import KVCACHE_SERVICE, pool_health_name
from kvsvc.server.config import PoolConfig
from kvsvc.tools.healthcheck import check_agent, check_grpc, main
from tests.deploy.files import free_port
from tests.server.harness import ServerThread, bring_up, running_server


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
