"""CI fails where a local run skips: the Hypothesis profile and the tool check."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from hypothesis import settings

from tests import tooling
from tests.tooling import hypothesis_profile, in_ci, require_tool

MISSING = "kvsvc-no-such-tool"


@pytest.mark.parametrize(
    ("environ", "profile"),
    [
        ({}, "default"),
        ({"CI": "true"}, "ci"),
        ({"CI": "1"}, "ci"),
        ({"CI": "false"}, "default"),
        ({"CI": "true", "HYPOTHESIS_PROFILE": "default"}, "default"),
        ({"HYPOTHESIS_PROFILE": "ci"}, "ci"),
    ],
)
def test_ci_runs_the_derandomized_profile(environ: dict[str, str], profile: str) -> None:
    assert hypothesis_profile(environ) == profile


def test_the_ci_profile_replays() -> None:
    ci = settings.get_profile("ci")
    assert ci.derandomize and ci.print_blob and ci.database is None


def test_the_loaded_profile_follows_the_environment() -> None:
    assert settings.default.derandomize == (hypothesis_profile(dict(os.environ)) == "ci")


def test_a_missing_tool_skips_locally_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    assert not in_ci()
    # BaseException: a skip where a failure is due must fail this test, not skip it.
    with pytest.raises(BaseException, match=MISSING) as skipped:
        require_tool(MISSING, "needed for nothing")
    assert skipped.type is pytest.skip.Exception
    monkeypatch.setenv("CI", "true")
    with pytest.raises(BaseException, match=f"{MISSING} is not available.*CI=true") as failed:
        require_tool(MISSING, "needed for nothing")
    assert failed.type is pytest.fail.Exception


def test_a_present_tool_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert require_tool("sh", "POSIX shell").endswith("sh")


def test_free_ports_lie_below_the_ephemeral_range_and_bind() -> None:
    """A port the kernel may give an outgoing connection could be taken before the test's
    server binds it; free_port never hands one out, nor the same port twice."""
    ephemeral = tooling.ephemeral_port_range()
    ports = [tooling.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port not in ephemeral
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_free_port_with_an_offset_has_both_ports_free() -> None:
    ephemeral = tooling.ephemeral_port_range()
    port = tooling.free_port(also_free_at=10000)
    for wanted in (port, port + 10000):
        assert wanted not in ephemeral
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", wanted))


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert tooling.ephemeral_port_range(str(setting)) == range(40000, 50001)
    assert tooling.ephemeral_port_range(str(tmp_path / "missing")) == range(32768, 61000)
