"""CI fails where a local run skips: the Hypothesis profile and the tool check."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

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
