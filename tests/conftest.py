"""Suite-wide settings: Hypothesis profiles, and what CI must have installed.

Hypothesis: locally the default profile runs (random examples, the example database
replays past failures). In CI (``CI=true``) the ``ci`` profile runs: derandomized, so a CI
failure is the same failure on every rerun and on a developer's machine with
``HYPOTHESIS_PROFILE=ci``; the failing example is printed with its ``@reproduce_failure``
blob; no database (a fresh clone has none, and a derandomized run needs none).
``HYPOTHESIS_PROFILE`` picks a profile by name either way.

CI also fails at once when a Python module that the suite imports with
``pytest.importorskip`` is missing: there the skip would hide a broken install.

Ports: kvsvc's default addresses are held for the whole session (tests/ports.py), so a test
that starts a server on one fails on every machine, not only where the port is taken.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

import kvsvc
from tests.ports import DefaultPortHolder
from tests.tooling import hypothesis_profile, in_ci

# Modules of the ``worker`` and ``dev`` extras that tests import with importorskip (the
# vLLM venv installs them too).
CI_REQUIRED_MODULES = (
    "torch",
    "yaml",
    "grpc_tools",
    "hypothesis",
    "kubernetes_validate",
    "cloudcoil.models.prometheus_operator",
)


def importable(name: str) -> bool:
    """Whether module ``name`` (dotted: its parents too) can be imported."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the tests that use it import it and fail (or CI says so below)
    pass
else:
    # Recent Hypothesis has a built-in "ci" profile like this one; registering it keeps the
    # behaviour on the older versions pyproject.toml allows. No deadline and no too_slow
    # health check: a loaded 2-core CI box must not fail a test for being slow.
    settings.register_profile(
        "ci",
        derandomize=True,
        database=None,
        print_blob=True,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile(hypothesis_profile(dict(os.environ)))


def pytest_configure(config: pytest.Config) -> None:
    if not in_ci():
        return
    absent = [name for name in CI_REQUIRED_MODULES if not importable(name)]
    if absent:
        raise pytest.UsageError(
            f"CI=true but {', '.join(absent)} cannot be imported: the tests that need them "
            "would skip; install the worker and dev extras (make test does)"
        )


@pytest.fixture(scope="session", autouse=True)
def default_ports_held() -> Iterator[DefaultPortHolder]:
    """kvsvc's default ports, held while the tests run: every test server takes port 0 or
    a free port (tests/ports.py)."""
    holder = DefaultPortHolder()
    try:
        yield holder
    finally:
        holder.close()


# Run on both builds of the core: its own tests (traces, property tests), those of the
# compiled Step path (kvsvc/tools/compile_core.py's COMPILED) and vLLM on kvsvc against
# stock vLLM (the engine's replica runs the core too); relative to tests/.
PURE_BUILD_PATHS = (
    "core",
    "server/test_step_paths.py",
    "server/test_wire_fast_paths.py",
    "vllm/test_vllm_on_kvsvc.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark what the pure-Python pass runs, and skip core patching on the compiled build.

    A test that patches a class or function of kvsvc.core cannot on the compiled build
    (mypyc's classes are closed, and compiled callers never look the function up again):
    there it is skipped, and make test's pure pass (``-m pure_build``) runs it.
    """
    tests_root = config.rootpath / "tests"
    compiled = kvsvc.native.BUILD == "mypyc"
    for item in items:
        patches_core = item.get_closest_marker("patches_core") is not None
        if patches_core or any(item.path.is_relative_to(tests_root / p) for p in PURE_BUILD_PATHS):
            item.add_marker(pytest.mark.pure_build)
        if compiled and patches_core:
            item.add_marker(
                pytest.mark.skip(
                    reason="patches kvsvc.core, which the compiled build forbids: make test's "
                    "pure pass (KVSVC_PURE_PYTHON=1 pytest -m pure_build) runs it"
                )
            )
