"""What the suite needs from the machine, and what happens when it is missing.

Locally a missing tool (promtool, kubectl, openssl, ...) skips the tests that need it, with
the reason and the way to install it. In CI (``CI=true``, set by ``.ci/run``, which
installs these tools) a missing tool fails the test instead: a skip there would hide that a
whole part of the suite did not run.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import NoReturn

import pytest

_TRUE = {"1", "true", "yes", "on"}


def in_ci(environ: dict[str, str] | None = None) -> bool:
    """Whether this run is CI's (``CI`` set to a true value, as CI services and .ci/run do)."""
    env = os.environ if environ is None else environ
    return env.get("CI", "").strip().lower() in _TRUE


def hypothesis_profile(environ: dict[str, str]) -> str:
    """The Hypothesis profile for this environment (tests/conftest.py loads it).

    ``HYPOTHESIS_PROFILE`` when set, else ``ci`` in CI (derandomized: a CI failure replays
    on every rerun) and ``default`` elsewhere.
    """
    named = environ.get("HYPOTHESIS_PROFILE", "").strip()
    if named:
        return named
    return "ci" if in_ci(environ) else "default"


def missing(what: str, reason: str) -> NoReturn:
    """Skip the calling test (locally) or fail it (in CI) because ``what`` is not there.

    Args:
        what: the missing tool or module, as a user would name it.
        reason: why the test needs it and how to get it.
    """
    message = f"{what} is not available: {reason}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: .ci/run installs it, so this is a CI setup bug)")
    pytest.skip(message)


def require_tool(name: str, reason: str) -> str:
    """The path of executable ``name``; skip locally or fail in CI when it is not installed.

    Args:
        name: the executable looked up on PATH.
        reason: what needs it and how to install it (e.g. ``apt-get install prometheus``).
    """
    path = shutil.which(name)
    if path is None:
        missing(name, reason)
    return path


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    """Poll ``predicate`` every 0.1 s until it holds; AssertionError naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
