"""The images built and run: deploy/images/build.sh builds both Dockerfile targets with
podman, then deploy/images/smoke.py's checks run them (published ports, health checks,
``kvsvc ctl`` from this host, a worker joining until READY, UID 10001, the health check
following ``--listen``).

Needs podman (Debian: podman buildah fuse-overlayfs slirp4netns uidmap runc debootstrap;
.ci/run installs them) and, for deploy/compose.yaml, podman-compose; without them the
tests skip, and fail under CI=true (:mod:`tests.tooling`). Without registry access
build.sh bootstraps a local Debian base once (about a minute) and keeps it in podman's
store; the image layers are cached there too, so a run after a source change rebuilds
only the kvsvc layers. The images are tagged ``kvsvc-test:server`` /
``kvsvc-test:worker``, apart from a user's ``kvsvc:*``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.deploy.files import REPO
from tests.tooling import load_script, missing, require_tool

IMAGES = REPO / "deploy" / "images"
TEST_IMAGE = "kvsvc-test"
PODMAN_PACKAGES = "podman buildah fuse-overlayfs slirp4netns uidmap runc debootstrap"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def load_smoke() -> ModuleType:
    """deploy/images/smoke.py as a module (it is a script, not a package)."""
    return load_script("kvsvc_images_smoke", IMAGES / "smoke.py")


smoke = load_smoke()


@dataclass(frozen=True)
class Built:
    """What build.sh reported: seconds per target, and the whole run's wall time."""

    seconds: dict[str, int]
    wall_s: float
    output: str


def podman_works() -> None:
    """Skip (or fail in CI) unless podman is installed and can run containers here."""
    require_tool(
        "podman",
        f"the image tests build and run the images (apt-get install "
        f"{PODMAN_PACKAGES}; .ci/run installs them)",
    )
    result = smoke.podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if result.returncode != 0:
        missing("a working podman", f"podman info failed: {result.stderr.strip()}")


@pytest.fixture(scope="module")
def built() -> Built:
    podman_works()
    env = {**smoke.podman_env(), "KVSVC_IMAGE": TEST_IMAGE}
    start = time.monotonic()
    result = subprocess.run(
        [str(IMAGES / "build.sh")], capture_output=True, text=True, env=env, timeout=1500
    )
    wall = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"build.sh exited {result.returncode}:\n{output[-6000:]}"
    seconds = {
        m.group(1): int(m.group(2))
        for m in re.finditer(rf"== {TEST_IMAGE}:(\w+) built in (\d+) s", output)
    }
    print(f"\nimage builds: {seconds}, build.sh {wall:.0f} s in all")
    return Built(seconds, wall, output)


def image_inspect(image: str) -> dict[str, Any]:
    """``podman image inspect`` of ``image`` (its config, and Healthcheck beside it)."""
    result = smoke.podman("image", "inspect", image)
    (found,) = json.loads(result.stdout)
    assert isinstance(found, dict)
    return found


def test_both_targets_build_with_their_healthcheck_and_user(built: Built) -> None:
    assert set(built.seconds) == {"server", "worker"}, built.output[-3000:]
    for target in ("server", "worker"):
        inspected = image_inspect(f"{TEST_IMAGE}:{target}")
        # --format docker keeps HEALTHCHECK (the OCI format drops it).
        health = inspected.get("Healthcheck") or {}
        assert health.get("Test", [None])[:4] == ["CMD", "python", "-m", "kvsvc.tools.healthcheck"]
        assert health["Retries"] == 3 and health["Interval"] > 0
        config = inspected["Config"]
        assert config["User"] == f"{smoke.UID}:{smoke.UID}"
        assert config["Entrypoint"] == ["kvsvc"]
    # The server image has no torch (its build asserts it; this is the image as shipped).
    result = smoke.podman(
        "run",
        "--rm",
        "--entrypoint",
        "python",
        f"{TEST_IMAGE}:server",
        "-c",
        "import torch",
        check=False,
    )
    assert result.returncode != 0 and "No module named 'torch'" in result.stderr


@pytest.fixture(scope="module")
def server(built: Built) -> Iterator[Any]:
    with smoke.run_container(
        f"{TEST_IMAGE}:server", publish=(smoke.GRPC_PORT, smoke.METRICS_PORT), role="server"
    ) as container:
        yield container


def test_server_with_its_own_command_is_healthy_and_reachable(server: Any) -> None:
    smoke.check_server_default(server)


def test_worker_joins_until_the_pool_is_ready(server: Any) -> None:
    with smoke.run_container(
        f"{TEST_IMAGE}:worker",
        publish=(smoke.AGENT_METRICS_PORT,),
        add_hosts={"server": server.ip()},
        role="worker",
    ) as worker:
        smoke.check_worker_joins(server, worker)


def test_health_check_follows_the_listen_port(built: Built) -> None:
    with smoke.run_container(
        f"{TEST_IMAGE}:server",
        smoke.other_port_command(),
        publish=(smoke.OTHER_PORT,),
        role="server-moved",
    ) as moved:
        smoke.check_health_follows_listen(moved, smoke.OTHER_PORT)


def test_an_unhealthy_server_is_reported_unhealthy(built: Built) -> None:
    """The checks can fail: the pool before any worker is NOT_SERVING, and a server that
    stops answering (its process frozen from outside) makes the image's HEALTHCHECK fail
    and podman record it unhealthy."""
    with smoke.run_container(
        f"{TEST_IMAGE}:server", publish=(smoke.GRPC_PORT,), role="server-frozen"
    ) as server:
        smoke.wait_healthy(server)
        service = f"kvsvc.v1.KVCacheService/{smoke.POOL}"
        pool = server.exec(
            "python", "-m", "kvsvc.tools.healthcheck", "--server", "auto", "--service", service
        )
        assert pool.returncode == 1 and "NOT_SERVING" in pool.stderr, pool.stderr
        smoke.podman("kill", "--signal", "STOP", server.name)
        try:
            # podman records "unhealthy" after the image's --retries=3 failures in a row,
            # counting none within its --start-period=10s.
            health = image_inspect(f"{TEST_IMAGE}:server")["Healthcheck"]
            deadline = time.monotonic() + health["StartPeriod"] / 1e9 + 30
            runs = 0
            while server.health_status() != "unhealthy":
                assert time.monotonic() < deadline, f"still {server.health_status()}"
                ok, output = server.healthcheck()
                assert not ok, output
                runs += 1
            assert runs >= health["Retries"]
        finally:
            smoke.podman("kill", "--signal", "CONT", server.name, check=False)


def test_build_sh_refuses_a_wheel_directory_without_torch(tmp_path: Path) -> None:
    podman_works()
    result = subprocess.run(
        [str(IMAGES / "build.sh"), "--torch-wheels", str(tmp_path), "worker"],
        capture_output=True,
        text=True,
        env={**os.environ, "KVSVC_IMAGE": TEST_IMAGE},
        timeout=60,
    )
    assert result.returncode == 2
    assert "holds no torch-*.whl" in result.stderr


def test_the_compose_stack_runs_with_podman_compose(built: Built, tmp_path: Path) -> None:
    """deploy/compose.yaml under podman-compose (Debian's package): the pool READY, the
    engine service served, both health checks healthy, Prometheus scraping both."""
    require_tool(
        "podman-compose", "Debian package podman-compose: apt-get install podman-compose "
        "(.ci/run installs it)"
    )  # fmt: skip
    env = {**smoke.podman_env(), "KVSVC_IMAGE": TEST_IMAGE}
    result = subprocess.run(
        [str(IMAGES / "build.sh"), "prometheus"], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with smoke.compose_up(TEST_IMAGE, tmp_path) as project:
        smoke.check_compose(project)
