"""The Makefile's venv setup: torch's CPU build from an explicit, overridable index, and a
first run that says what it installs (``make -n``: the commands, nothing run)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tooling import require_tool

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def dry_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The shell lines ``make -n venv`` would run for a venv that does not exist yet."""
    make = require_tool("make", "the Makefile tests run `make -n` (apt-get install make)")
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [make, "-n", "-C", str(REPO), "venv", f"VENV={tmp_path / 'venv'}", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def torch_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if "torch==" in line and "pip install" in line]
    return line


def test_torch_comes_from_the_cpu_index_unless_pip_finds_a_local_wheel(tmp_path: Path) -> None:
    line = torch_line(dry_run(tmp_path))
    # First: is there a wheel pip finds without any index (find-links)? Then that one, and
    # TORCH_INDEX_URL is never contacted (it may be unreachable: pip would retry it).
    probe, _, rest = line.partition("then")
    assert "--dry-run --no-index --no-deps" in probe and "torch==2.13.0" in probe
    local, _, fallback = rest.partition("else")
    assert "pip install --progress-bar off torch==2.13.0" in local
    assert "--extra-index-url" not in local and "--index-url" not in local
    # Otherwise the CPU build's index is added (its +cpu is a higher version than PyPI's
    # plain 2.13.0, a CUDA build, so pip takes it).
    assert f"--extra-index-url {CPU_INDEX} torch==2.13.0" in fallback


@pytest.mark.parametrize("how", ["command line", "environment"])
def test_a_given_torch_index_is_used_as_given(tmp_path: Path, how: str) -> None:
    cuda = "https://download.pytorch.org/whl/cu128"
    if how == "command line":
        lines = dry_run(tmp_path, f"TORCH_INDEX_URL={cuda}")
    else:
        lines = dry_run(tmp_path, env={"TORCH_INDEX_URL": cuda})
    line = torch_line(lines)
    # Asked for explicitly (a GPU machine): no local-wheel shortcut, that index.
    assert line.startswith('if [ "no" = yes ]')
    assert f"--extra-index-url {cuda} torch==2.13.0" in line
    assert CPU_INDEX not in line


def test_the_first_run_says_what_it_installs(tmp_path: Path) -> None:
    lines = dry_run(tmp_path)
    echoed = [line for line in lines if line.startswith("echo ")]
    sizes = [
        m.group(1)
        for line in echoed
        if (m := re.search(r"setting up .*~1-3 min.*about ([\d.]+ GiB)", line))
    ]
    assert sizes, echoed
    # README and the install page say the same size as the Makefile (measured: 1.4 GiB).
    for page in ("README.md", "docs/install.md"):
        assert f"about {sizes[0]}" in " ".join((REPO / page).read_text().split()), page
    assert any("kvsvc (editable)" in line for line in echoed), echoed
    # The long steps are not silenced: pip shows what it downloads and installs.
    for line in lines:
        if "pip install" in line and ("torch==" in line or "-e " in line):
            for command in line.split(";"):
                if "pip install" in command and "--dry-run" not in command:
                    assert " -q" not in command, command


@pytest.mark.parametrize("index", [None, "https://download.pytorch.org/whl/cu128"])
def test_torch_is_checked_right_after_its_install(tmp_path: Path, index: str | None) -> None:
    """Before kvsvc's own install: a venv whose torch is not the build asked for stops
    there (kvsvc.tools.torchcheck, tests/test_torchcheck.py), with the index it asked."""
    lines = dry_run(tmp_path, *([f"TORCH_INDEX_URL={index}"] if index else []))
    installed = lines.index(torch_line(lines))
    check = lines[installed + 1]
    assert check.endswith(f"-m kvsvc.tools.torchcheck '{index or CPU_INDEX}'"), check
    assert any("pip install" in line and "-e '.[" in line for line in lines[installed + 2 :])


def test_venv_builds_the_compiled_core_after_installing(tmp_path: Path) -> None:
    lines = dry_run(tmp_path)
    install = next(i for i, line in enumerate(lines) if "pip install" in line and "-e " in line)
    (build,) = [i for i, line in enumerate(lines) if "-m kvsvc.tools.compile_core" in line]
    assert build > install


def test_the_editable_install_hides_setuptools_s_editable_warning(tmp_path: Path) -> None:
    """setuptools warns on every editable install (a box about same-named folders), which
    pip shows in the middle of `make venv`. The Makefile's install line sets a warning
    filter; it must match the warning this setuptools emits (run here as it is emitted)."""
    pytest.importorskip("setuptools")
    (line,) = [line for line in dry_run(tmp_path) if "pip install" in line and " -e " in line]
    assignment = shlex.split(line)[0]
    name, _, value = assignment.partition("=")
    assert name == "PYTHONWARNINGS", line
    emit = (
        "from setuptools.warnings import InformationOnly\n"
        "InformationOnly.emit('Editable installation.', 'Please be careful with folders')\n"
    )

    def stderr(env: dict[str, str]) -> str:
        done = subprocess.run(
            [sys.executable, "-c", emit], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == 0, done.stderr
        return done.stderr

    base = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    assert "Editable installation" in stderr(base)  # what the filter is for
    assert stderr({**base, "PYTHONWARNINGS": value}) == ""


def test_every_target_is_on_the_install_page() -> None:
    """docs/install.md is where a reader looks a target up: each one of the Makefile's is
    there (its "Other targets" table missed venv-vllm and node-tools)."""
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    declared = re.search(r"^\.PHONY: (.*)$", makefile, re.M)
    assert declared
    page = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    missing = [t for t in declared.group(1).split() if f"`make {t}`" not in page]
    # `make demo` and `make test` head the page in a code block, not in backticks.
    missing = [t for t in missing if f"make {t}   #" not in page]
    assert not missing, f"docs/install.md does not list make {', make '.join(missing)}"


def test_the_pages_give_the_compile_s_time_as_the_build_announces_it() -> None:
    """README's "1-3 minutes" left out the mypyc compile that `make demo` runs next (~1.5
    minutes here): the pages give it, as the build's own first line does."""
    from kvsvc.tools.compile_core import FIRST_BUILD_MINUTES

    for page in ("README.md", "docs/install.md"):
        text = " ".join((REPO / page).read_text(encoding="utf-8").split())
        assert f"compiles the core with mypyc (about {FIRST_BUILD_MINUTES} minutes" in text, page
