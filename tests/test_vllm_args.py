"""``kvsvc vllm-args`` and ``vllm_kwargs``: the pinned names, without vLLM installed."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from kvsvc.integrations.vllm import settings_from_additional_config, vllm_kwargs


def test_vllm_kwargs_names_kvsvc_classes_and_settings() -> None:
    kwargs = vllm_kwargs("127.0.0.1:50051", "vllm")
    assert kwargs["scheduler_cls"] == "kvsvc.integrations.vllm.scheduler.KvsvcScheduler"
    assert kwargs["worker_cls"] == "kvsvc.integrations.vllm.worker.KvsvcWorker"
    settings = settings_from_additional_config(kwargs["additional_config"])
    assert (settings.server, settings.pool, settings.auth_token) == (
        "127.0.0.1:50051",
        "vllm",
        None,
    )
    with_token = vllm_kwargs("127.0.0.1:50051", "vllm", auth_token="s3cret")
    assert settings_from_additional_config(with_token["additional_config"]).auth_token == "s3cret"


@pytest.mark.parametrize(("server", "pool"), [("", "vllm"), ("nohost", "vllm"), ("h:1", "")])
def test_vllm_kwargs_refuses_bad_settings(server: str, pool: str) -> None:
    with pytest.raises(ValueError, match=r"server|pool"):
        vllm_kwargs(server, pool)


def test_settings_without_vllm_kwargs_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="vllm_kwargs"):
        settings_from_additional_config({})


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", "vllm-args", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_prints_vllm_serve_flags_matching_vllm_kwargs() -> None:
    done = run_cli("--server", "10.0.0.1:7000", "--pool", "p1")
    assert done.returncode == 0, done.stderr
    flags = shlex.split(done.stdout)
    kwargs = vllm_kwargs("10.0.0.1:7000", "p1")
    assert flags[flags.index("--scheduler-cls") + 1] == kwargs["scheduler_cls"]
    assert flags[flags.index("--worker-cls") + 1] == kwargs["worker_cls"]
    assert json.loads(flags[flags.index("--additional-config") + 1]) == kwargs["additional_config"]
    as_json = run_cli("--server", "10.0.0.1:7000", "--pool", "p1", "--json")
    assert json.loads(as_json.stdout) == kwargs


def test_cli_bad_server_is_a_clear_error() -> None:
    done = run_cli("--server", "nohost", "--pool", "p1")
    assert done.returncode != 0
    assert "HOST:PORT" in done.stderr


def test_frames_carries_the_schedulers_target_and_leaves_the_workers_on_grpc() -> None:
    """The scheduler's calls go to ``frames:ADDRESS``; the workers' ``server`` is
    unchanged (registration and the plan stream are gRPC's), in both forms of the args."""
    kwargs = vllm_kwargs("10.0.0.1:7000", "p1", frames="unix:/run/kvsvc/frames.sock")
    settings = settings_from_additional_config(kwargs["additional_config"])
    assert settings.server == "10.0.0.1:7000"
    assert settings.engine_target == "frames:unix:/run/kvsvc/frames.sock"
    assert (
        settings_from_additional_config(vllm_kwargs("h:1", "p")["additional_config"]).engine_target
        == "h:1"
    )
    done = run_cli(
        "--server", "10.0.0.1:7000", "--pool", "p1", "--frames", "unix:/run/kvsvc/frames.sock"
    )
    assert done.returncode == 0, done.stderr
    flags = shlex.split(done.stdout)
    assert json.loads(flags[flags.index("--additional-config") + 1]) == kwargs["additional_config"]


@pytest.mark.parametrize("frames", ["nope", "frames:unix:/x.sock", ""])
def test_a_bad_frames_address_is_refused_naming_the_setting(frames: str) -> None:
    with pytest.raises(ValueError, match="frames must be unix:PATH or HOST:PORT"):
        vllm_kwargs("h:1", "p", frames=frames)
