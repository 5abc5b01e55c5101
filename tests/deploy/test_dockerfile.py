"""The Dockerfile, read statically (no Docker engine here): stages, user, targets, ports,
health checks, and that every file it copies reaches the build context.

tests/deploy/test_commands_live.py runs its CMD and HEALTHCHECK commands for real.
"""

from __future__ import annotations

import re

import pytest

from kvsvc.server.config import DEFAULT_LISTEN, DEFAULT_METRICS_LISTEN
from tests.deploy.files import (
    AGENT_METRICS_PORT,
    REPO,
    Stage,
    dockerfile_global_args,
    dockerfile_stages,
    dockerignore_rules,
    effective,
    exposed_ports,
    flag_value,
    in_build_context,
    pattern_regex,
    port_of,
    stage_chain,
    tracked_files,
)

UID = "10001"


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return dockerfile_stages()


def test_two_runtime_targets_and_server_is_the_default(stages: dict[str, Stage]) -> None:
    assert {"server", "worker"} <= set(stages)
    # `docker build .` without --target builds the last stage: the small one.
    assert list(stages)[-1] == "server"


def test_multi_stage_on_a_slim_base(stages: dict[str, Stage]) -> None:
    args = dockerfile_global_args()
    for name in ("server", "worker"):
        chain = stage_chain(stages, name)
        # The default base; deploy/images/build.sh may pass a local one as BASE_IMAGE.
        assert chain[-1].base == "${BASE_IMAGE}", chain[-1].base
        root = args["BASE_IMAGE"].replace("${PYTHON_VERSION}", args.get("PYTHON_VERSION", ""))
        assert re.fullmatch(r"python:3\.1[1-9]-slim", root), root
        # The runtime stage copies a built venv from another stage, not the sources.
        copies = stages[name].find("COPY")
        assert any("--from=" in c.args and "/opt/kvsvc/venv" in c.args for c in copies)
        assert not any(c.args.split()[0] in ("kvsvc", "clients", ".") for c in copies)
        assert len(chain) >= 2


def test_non_root_user_with_a_fixed_uid(stages: dict[str, Stage]) -> None:
    base = stage_chain(stages, "server")[-1]
    useradd = " ".join(i.args for i in base.find("RUN"))
    assert f"--uid {UID}" in useradd and f"--gid {UID}" in useradd
    for name in ("server", "worker"):
        user = effective(stages, name, "USER").args
        assert user.split(":")[0] == UID, f"{name} runs as {user!r}"


def test_only_the_worker_installs_torch(stages: dict[str, Stage]) -> None:
    def installs_torch(name: str) -> bool:
        runs = " ".join(
            i.args
            for stage in stage_chain(stages, name)
            for i in stage.find("RUN")
            if "pip install" in i.args
        )
        copied = [c.args for c in stages[name].find("COPY") if "--from=" in c.args]
        sources = [m.group(1) for c in copied if (m := re.search(r"--from=(\S+)", c))]
        runs += " ".join(
            i.args for s in sources for stage in stage_chain(stages, s) for i in stage.find("RUN")
        )
        return "torch==" in runs or "[worker]" in runs

    assert installs_torch("worker")
    assert not installs_torch("server")
    # The server venv also proves it: its build fails if torch got in.
    venv_runs = " ".join(i.args for i in stages["server-venv"].find("RUN"))
    assert '! /opt/kvsvc/venv/bin/python -c "import torch"' in venv_runs


def test_ports_match_the_server_defaults(stages: dict[str, Stage]) -> None:
    grpc_port, metrics_port = port_of(DEFAULT_LISTEN), port_of(DEFAULT_METRICS_LISTEN)
    assert exposed_ports(stages, "server") == {grpc_port, metrics_port}
    assert exposed_ports(stages, "worker") == {AGENT_METRICS_PORT}
    server_cmd = effective(stages, "server", "CMD").exec_form()
    assert port_of(flag_value(server_cmd, "--listen")) == grpc_port
    assert port_of(flag_value(server_cmd, "--metrics-listen")) == metrics_port
    worker_cmd = effective(stages, "worker", "CMD").exec_form()
    assert port_of(flag_value(worker_cmd, "--metrics-listen")) == AGENT_METRICS_PORT
    assert port_of(flag_value(worker_cmd, "--server")) == grpc_port


def test_healthchecks_use_the_health_tool_on_the_exposed_ports(stages: dict[str, Stage]) -> None:
    server = effective(stages, "server", "HEALTHCHECK")
    argv = server.exec_form()
    assert argv[:3] == ["python", "-m", "kvsvc.tools.healthcheck"]
    # Not a fixed port: `serve --listen 0.0.0.0:6000` must be checked on 6000. auto reads
    # the container's kvsvc serve command (tests/deploy/test_healthcheck_auto.py).
    assert flag_value(argv, "--server") == "auto"
    worker = effective(stages, "worker", "HEALTHCHECK").exec_form()
    assert worker[:3] == ["python", "-m", "kvsvc.tools.healthcheck"]
    # The same for the agent: its /metrics port is the one its --metrics-listen names.
    assert flag_value(worker, "--agent-metrics") == "auto"
    worker_cmd = effective(stages, "worker", "CMD").exec_form()
    assert port_of(flag_value(worker_cmd, "--metrics-listen")) == AGENT_METRICS_PORT
    for name in ("server", "worker"):
        options = effective(stages, name, "HEALTHCHECK").options()
        assert {"interval", "timeout", "start-period", "retries"} <= set(options)


def test_entrypoint_is_the_kvsvc_cli(stages: dict[str, Stage]) -> None:
    for name, command in (("server", "serve"), ("worker", "worker")):
        assert effective(stages, name, "ENTRYPOINT").exec_form() == ["kvsvc"]
        assert effective(stages, name, "CMD").exec_form()[0] == command


def test_every_copied_file_reaches_the_build_context(stages: dict[str, Stage]) -> None:
    rules = dockerignore_rules()
    sources = [
        source
        for stage in stages.values()
        for copy in stage.find("COPY")
        if "--from=" not in copy.args
        for source in copy.args.split()[:-1]
        if not source.startswith("--")
    ]
    assert sources, "the Dockerfile copies nothing from the context"
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such file in the repo"
        files = list(tracked_files(source))
        assert files, f"COPY {source}: nothing to copy"
        left_out = [f for f in files if not in_build_context(f, rules)]
        assert not left_out, f".dockerignore drops files COPY {source} needs: {left_out[:5]}"


def test_dockerignore_keeps_the_rest_out() -> None:
    rules = dockerignore_rules()
    for path in (".venv/bin/python", ".git/HEAD", "tests/server/harness.py", "benchmarks/x.py"):
        assert not in_build_context(path, rules), path
    for path in ("kvsvc/__pycache__/cli.cpython-311.pyc", "deploy/compose.yaml"):
        assert not in_build_context(path, rules), path
    assert in_build_context("kvsvc/cli.py", rules)
    assert in_build_context("deploy/demo_engine.py", rules)


def test_dockerignore_matcher_follows_docker_rules() -> None:
    """The matcher itself: parents match, the last match wins, ``**`` spans directories."""
    rules = [(True, pattern_regex("*")), (False, pattern_regex("src"))]
    rules.append((True, pattern_regex("**/*.pyc")))
    assert in_build_context("src/a/b.py", rules)
    assert not in_build_context("src/a/b.pyc", rules)
    assert not in_build_context("other/b.py", rules)
    assert pattern_regex("**/__pycache__").fullmatch("__pycache__")
    assert pattern_regex("a/**/b").fullmatch("a/x/y/b")
