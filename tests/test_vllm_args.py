"""``kvsvc vllm-args`` and ``vllm_kwargs``: the pinned names, without vLLM installed."""

from __future__ import annotations

import json
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


def unquoted(output: str) -> list[str]:
    """The words an unquoted ``$(...)`` makes of ``output``, by bash itself: split, and
    globbed with failglob on (a word with a glob character and no match fails the line)."""
    done = subprocess.run(
        ["bash", "-O", "failglob", "-O", "extglob", "-c", 'printf "%s\\0" $1', "bash", output],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.split("\0")[:-1]


def additional_config(flags: list[str]) -> object:
    (flag,) = [f for f in flags if f.startswith("--additional-config=")]
    return json.loads(flag.removeprefix("--additional-config="))


def test_cli_prints_vllm_serve_flags_matching_vllm_kwargs() -> None:
    done = run_cli("--server", "10.0.0.1:7000", "--pool", "p1")
    assert done.returncode == 0, done.stderr
    flags = unquoted(done.stdout)
    kwargs = vllm_kwargs("10.0.0.1:7000", "p1")
    assert flags[flags.index("--scheduler-cls") + 1] == kwargs["scheduler_cls"]
    assert flags[flags.index("--worker-cls") + 1] == kwargs["worker_cls"]
    assert additional_config(flags) == kwargs["additional_config"]
    assert len(flags) == 5
    as_json = run_cli("--server", "10.0.0.1:7000", "--pool", "p1", "--json")
    assert json.loads(as_json.stdout) == kwargs


@pytest.mark.parametrize(
    ("server", "frames"),
    [
        ("[::1]:50051", None),  # a glob bracket
        ("h:1", "unix:/run/my kvsvc/*?[x]@(y)!+{a,b}'\"\\é😀.sock"),  # everything else
    ],
)
def test_unquoted_substitution_hands_every_value_over_unchanged(
    server: str, frames: str | None
) -> None:
    """What README writes, ``$(kvsvc vllm-args ...)`` without quotes, gives the program the
    settings themselves, whatever characters they hold (no quote left in place, nothing
    split or globbed)."""
    args = ["--server", server, "--pool", "p1"] + (["--frames", frames] if frames else [])
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    flags = unquoted(done.stdout)
    assert len(flags) == 5
    assert additional_config(flags) == vllm_kwargs(server, "p1", frames=frames)["additional_config"]


def test_shell_inert_json_refuses_what_it_cannot_write() -> None:
    from kvsvc.integrations.vllm.config import shell_inert_json

    with pytest.raises(ValueError, match="one shell word"):
        shell_inert_json({"a": [1, 2]})


def test_help_and_docs_name_the_token_variables_vllms_sides_read() -> None:
    """The scheduler is an engine and the workers are agents: the help and docs/vllm.md name
    the variables resolve_token reads for those roles, and the shared fallback."""
    from pathlib import Path

    from kvsvc_client import resolve_token

    assert resolve_token("engine", environ={"KVSVC_ENGINE_TOKEN": "e"}) == "e"
    assert resolve_token("agent", environ={"KVSVC_AGENT_TOKEN": "a"}) == "a"
    assert resolve_token("agent", environ={"KVSVC_AUTH_TOKEN": "x"}) == "x"
    names = ("KVSVC_ENGINE_TOKEN", "KVSVC_AGENT_TOKEN", "KVSVC_AUTH_TOKEN")
    help_text = " ".join(run_cli("--help").stdout.split())
    page = Path(__file__).resolve().parents[1].joinpath("docs", "vllm.md").read_text()
    # The page's opening, up to how it works inside: how to run it.
    vllm_section = page[: page.index("\n## How it stays fast and exact")]
    for text in (help_text, vllm_section):
        for name in names:
            assert name in text
    assert "vLLM's scheduler reads KVSVC_ENGINE_TOKEN" in help_text
    assert "its workers KVSVC_AGENT_TOKEN" in help_text


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
    assert additional_config(unquoted(done.stdout)) == kwargs["additional_config"]


@pytest.mark.parametrize("frames", ["nope", "frames:unix:/x.sock", ""])
def test_a_bad_frames_address_is_refused_naming_the_setting(frames: str) -> None:
    with pytest.raises(ValueError, match="frames must be unix:PATH or HOST:PORT"):
        vllm_kwargs("h:1", "p", frames=frames)


def test_step_sender_goes_through_both_forms_and_bad_values_are_refused() -> None:
    """``step_sender`` reaches the scheduler's settings from ``vllm_kwargs`` and from the
    CLI's flags alike (left out of the config at its default); an unknown value, or
    ``inline`` without frames, is refused naming the setting."""
    kwargs = vllm_kwargs("h:1", "p", frames="unix:/run/f.sock", step_sender="inline")
    assert settings_from_additional_config(kwargs["additional_config"]).step_sender == "inline"
    default = vllm_kwargs("h:1", "p", frames="unix:/run/f.sock")["additional_config"]
    assert "step_sender" not in default["kvsvc"]
    assert settings_from_additional_config(default).step_sender == "thread"
    done = run_cli(
        "--server", "h:1", "--pool", "p", "--frames", "unix:/run/f.sock", "--step-sender", "inline"
    )
    assert done.returncode == 0, done.stderr
    assert additional_config(unquoted(done.stdout)) == kwargs["additional_config"]
    with pytest.raises(ValueError, match="step_sender must be one of thread, inline"):
        vllm_kwargs("h:1", "p", step_sender="eager")
    with pytest.raises(ValueError, match="step_sender 'inline' needs frames"):
        vllm_kwargs("h:1", "p", step_sender="inline")
    raw = {"kvsvc": {"server": "h:1", "pool": "p", "step_sender": "later"}}
    with pytest.raises(ValueError, match="step_sender must be one of"):
        settings_from_additional_config(raw)


def test_steps_per_call_goes_through_both_forms_and_bad_values_are_refused() -> None:
    """``steps_per_call`` reaches the scheduler's settings from ``vllm_kwargs`` and from the
    CLI's flags alike (left out of the config at its default, 1); a value outside 1..16,
    or one that is not a whole number, is refused naming the setting, by either form."""
    kwargs = vllm_kwargs("h:1", "p", steps_per_call=4)
    assert settings_from_additional_config(kwargs["additional_config"]).steps_per_call == 4
    default = vllm_kwargs("h:1", "p")["additional_config"]
    assert "steps_per_call" not in default["kvsvc"]
    assert settings_from_additional_config(default).steps_per_call == 1
    done = run_cli("--server", "h:1", "--pool", "p", "--steps-per-call", "4")
    assert done.returncode == 0, done.stderr
    assert additional_config(unquoted(done.stdout)) == kwargs["additional_config"]
    assert (
        vllm_kwargs("h:1", "p", steps_per_call=16)["additional_config"]["kvsvc"]["steps_per_call"]
        == 16
    )
    for bad in (0, 17, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="steps_per_call must be a whole number from 1 to 16"):
            vllm_kwargs("h:1", "p", steps_per_call=bad)  # type: ignore[arg-type]
        raw = {"kvsvc": {"server": "h:1", "pool": "p", "steps_per_call": bad}}
        with pytest.raises(ValueError, match="steps_per_call must be"):
            settings_from_additional_config(raw)
    refused = run_cli("--server", "h:1", "--pool", "p", "--steps-per-call", "0")
    assert refused.returncode != 0
    assert "steps_per_call must be a whole number from 1 to 16, got 0" in refused.stderr


@pytest.mark.parametrize(
    ("key", "flag", "zero_allowed"),
    [
        ("rpc_timeout", "--rpc-timeout", False),
        ("unavailable_timeout", "--unavailable-timeout", True),
        ("plan_timeout", "--plan-timeout", False),
    ],
)
def test_timeouts_go_through_every_form_and_bad_values_are_refused(
    key: str, flag: str, zero_allowed: bool
) -> None:
    """Each timeout reaches the settings from ``vllm_kwargs``, from ``additional_config``
    and from the CLI's flag alike (left out of the config at its default); one that is not
    a number of seconds in range (negative, 0 where a wait is needed, past a day, not
    finite, a bool, a string) is refused naming the setting, by every form, where a bare
    ``float()`` took "5" and ``nan``."""
    kwargs = vllm_kwargs("h:1", "p", **{key: 7.5})
    assert kwargs["additional_config"]["kvsvc"][key] == 7.5
    assert getattr(settings_from_additional_config(kwargs["additional_config"]), key) == 7.5
    default = vllm_kwargs("h:1", "p")["additional_config"]
    assert key not in default["kvsvc"]
    done = run_cli("--server", "h:1", "--pool", "p", flag, "7.5")
    assert done.returncode == 0, done.stderr
    assert additional_config(unquoted(done.stdout)) == kwargs["additional_config"]
    assert (
        getattr(
            settings_from_additional_config({"kvsvc": {"server": "h:1", "pool": "p", key: 86_400}}),
            key,
        )
        == 86_400.0
    )
    edge = (
        settings_from_additional_config({"kvsvc": {"server": "h:1", "pool": "p", key: 0}})
        if zero_allowed
        else None
    )
    assert edge is None or getattr(edge, key) == 0.0
    bads: list[object] = [-1, 86_401, float("nan"), float("inf"), True, "5", None]
    if not zero_allowed:
        bads.append(0)
    for bad in bads:
        with pytest.raises(ValueError, match=f"{key} must be a number of seconds"):
            vllm_kwargs("h:1", "p", **{key: bad})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"{key} must be a number of seconds"):
            settings_from_additional_config({"kvsvc": {"server": "h:1", "pool": "p", key: bad}})
    refused = run_cli("--server", "h:1", "--pool", "p", flag, "-1")
    assert refused.returncode != 0
    assert f"{key} must be a number of seconds" in refused.stderr and "got -1.0" in refused.stderr
