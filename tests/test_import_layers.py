"""The layer contracts ``make lint`` runs (``[tool.importlinter]`` in pyproject.toml,
docs/architecture.md "Layers") hold on this tree, and each one refuses the import it is
there to refuse: one planted into a copy of the tree, the contract's check fails naming
the importer and the imported module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tooling import missing

ROOT = Path(__file__).resolve().parent.parent


def lint_imports() -> str:
    """The venv's lint-imports (the dev extra installs it beside this interpreter)."""
    path = Path(sys.executable).parent / "lint-imports"
    if not path.exists():
        missing("lint-imports", "pip install -e '.[dev]' (import-linter) or make venv")
    return str(path)


def copy_tree(destination: Path) -> Path:
    """The packages and the contracts, without builds or caches."""
    ignore = shutil.ignore_patterns("_compiled", "__pycache__", "*.so")
    shutil.copytree(ROOT / "kvsvc", destination / "kvsvc", ignore=ignore)
    shutil.copytree(ROOT / "clients", destination / "clients", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", destination / "pyproject.toml")
    return destination


def check(tree: Path, contract: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'clients'}"}
    args = [lint_imports(), "--no-cache", "--no-logo"]
    if contract is not None:
        args += ["--contract", contract]
    return subprocess.run(
        args, cwd=tree, env=env, capture_output=True, text=True, timeout=240, check=False
    )


def plant(tree: Path, module: str, line: str) -> None:
    """Append a module-level import to ``module`` (a file below the copy's root)."""
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}\n")


def test_every_contract_holds_on_this_tree(tmp_path: Path) -> None:
    result = check(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


# (contract id, file of the copy, the import planted there, importer -> imported as the
# report names them)
VIOLATIONS = [
    pytest.param(
        "layers",
        "kvsvc/core/pool.py",
        "import kvsvc.planner",
        "kvsvc.core.pool -> kvsvc.planner",
        id="core-imports-the-planner-above-it",
    ),
    pytest.param(
        "domain",
        "kvsvc/specs/base.py",
        "import grpc",
        "kvsvc.specs.base -> grpc",
        id="domain-imports-grpc",
    ),
    pytest.param(
        "server",
        "kvsvc/server/app.py",
        "import kvsvc.integrations.vllm.events",
        "kvsvc.server.app -> kvsvc.integrations.vllm.events",
        id="server-imports-its-plugin",
    ),
    pytest.param(
        "client",
        "clients/kvsvc_client/_wire.py",
        "import kvsvc.server.wire",
        "kvsvc_client._wire -> kvsvc.server.wire",
        id="client-imports-the-server",
    ),
    pytest.param(
        "acyclic",
        "kvsvc/server/persistence/records.py",
        "import kvsvc.server.pool",
        ".persistence -> .pool",
        id="persistence-imports-the-pool-that-uses-it",
    ),
]


@pytest.mark.parametrize(("contract", "module", "line", "named"), VIOLATIONS)
def test_each_contract_refuses_its_import(
    tmp_path: Path, contract: str, module: str, line: str, named: str
) -> None:
    tree = copy_tree(tmp_path)
    plant(tree, module, line)
    result = check(tree, contract)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout and named in result.stdout, result.stdout
