"""What the suite needs from the machine, and what happens when it is missing.

Locally a missing tool (promtool, kubectl, openssl, ...) skips the tests that need it, with
the reason and the way to install it. In CI (``CI=true``, set by ``.ci/run``, which
installs these tools) a missing tool fails the test instead: a skip there would hide that a
whole part of the suite did not run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
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


# Ports handed out by free_port in this process: two calls never return the same one, even
# before either is bound.
_handed_out: set[int] = set()
_port_rng = random.Random(os.getpid())
# Where free_port looks: the registered-port range, below Linux's default ephemeral range.
_LOWEST_PORT = 10000


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> range:
    """The ports the kernel gives outgoing connections (Linux's default 32768-60999 where
    the file cannot be read)."""
    try:
        low, high = (int(part) for part in Path(path).read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(also_free_at: int = 0) -> int:
    """A loopback TCP port nothing listens on, for a process started on a fixed port.

    Asking the kernel for port 0 would hand out a port from the ephemeral range, and any
    outgoing connection made before the test's server binds it (a redis-cli, a cluster
    node's gossip, an agent's retries) can take that same port as its local end: the server
    then fails with "address already in use". So the port is drawn from below that range,
    where the kernel never picks local ends on its own, and checked by binding it. With
    ``also_free_at`` the port at that offset (Redis Cluster's bus, port + 10000) is drawn
    from the same range and checked too.
    """
    ephemeral = ephemeral_port_range()
    top = min(ephemeral.start, 65536) - also_free_at
    if top - _LOWEST_PORT < 1000:
        raise RuntimeError(
            f"no room for test ports below the ephemeral range {ephemeral.start}-"
            f"{ephemeral.stop - 1} (offset {also_free_at})"
        )
    for _ in range(1000):
        port = _port_rng.randrange(_LOWEST_PORT, top)
        wanted = [port, port + also_free_at] if also_free_at else [port]
        if any(p in _handed_out for p in wanted) or not all(_bindable(p) for p in wanted):
            continue
        _handed_out.update(wanted)
        return port
    raise RuntimeError("no free loopback port found in 1000 tries")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def load_script(name: str, path: Path) -> ModuleType:
    """A script of the repository (a benchmark, a tool: not a package) as module ``name``,
    registered in ``sys.modules``, where the dataclasses it defines look their module up."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@contextmanager
def script_module(name: str, path: Path) -> Iterator[ModuleType]:
    """:func:`load_script` for the block, ``sys.modules`` as it was after it."""
    before = sys.modules.get(name)
    try:
        yield load_script(name, path)
    finally:
        if before is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before
