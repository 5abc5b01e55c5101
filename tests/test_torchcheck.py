"""``make venv``'s torch check (kvsvc.tools.torchcheck), run as the Makefile runs it, with
a stand-in ``torch`` package of each build on the path: a venv whose pip fell back on
PyPI's CUDA torch (the CPU index unreachable) stops, saying what to set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU = "https://download.pytorch.org/whl/cpu"
CU128 = "https://download.pytorch.org/whl/cu128"


def check(tmp_path: Path, version: str, index: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return subprocess.run(
        [sys.executable, "-m", "kvsvc.tools.torchcheck", index],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{REPO}"},
    )


@pytest.mark.parametrize(
    ("version", "index"), [("2.13.0+cpu", CPU), ("2.13.0+cu128", CU128), ("2.13.0+cpu", "")]
)
def test_the_build_asked_for_passes(tmp_path: Path, version: str, index: str) -> None:
    done = check(tmp_path, version, index or "https://mirror.example/torch/simple")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"torch {version}: the build asked for"


def test_pypi_s_cuda_torch_instead_of_the_cpu_one_stops_saying_what_to_set(
    tmp_path: Path,
) -> None:
    done = check(tmp_path, "2.13.0", CPU)
    assert done.returncode == 1
    message = done.stderr.strip()
    assert message.startswith(
        "error: torch 2.13.0 is installed, not the +cpu build asked for: pip took PyPI's "
        "build (a CUDA one, with nvidia-* packages), which means it could not reach "
        f"TORCH_INDEX_URL ({CPU})"
    )
    for what in ("Set TORCH_INDEX_URL", "PIP_FIND_LINKS", "make clean", CU128):
        assert what in message, what


def test_a_cpu_build_where_a_cuda_index_was_given_stops(tmp_path: Path) -> None:
    done = check(tmp_path, "2.13.0+cpu", CU128)
    assert done.returncode == 1
    assert "not the +cu128 build asked for: pip took the +cpu build" in done.stderr


def test_the_check_of_the_real_torch_prints_no_numpy_warning(tmp_path: Path) -> None:
    """The Makefile runs the check before numpy is installed (kvsvc's own install brings
    it): torch's "Failed to initialize NumPy" warning was noise in every first `make venv`."""
    pytest.importorskip("torch")
    absent = tmp_path / "site" / "numpy"
    absent.mkdir(parents=True)
    (absent / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvsvc.tools.torchcheck", "https://mirror.example/torch/simple"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{absent.parent}{os.pathsep}{REPO}"},
    )
    import torch

    build = str(torch.__version__).partition("+")[2]
    if build != "cpu":
        pytest.skip(f"this torch is the +{build} build: the check would stop on it")
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr, done.stderr
