"""Which build of the core runs: the mypyc-compiled modules or the pure-Python ones.

``kvsvc/_compiled/`` holds extension modules built from some of kvsvc's own modules
(``python -m kvsvc.tools.compile_core``; ``make venv`` and the Dockerfile run it). They
live apart from the ``.py`` files so that both builds run from one tree: :func:`install`
(called by ``kvsvc/__init__.py``) puts a finder first on ``sys.meta_path`` that answers
for exactly the compiled module names, unless

- ``KVSVC_PURE_PYTHON=1`` is set (the pure build: the test suite runs a subset on it),
- nothing was built (no C compiler at install time), or it was built for another Python,
- a compiled module's source changed since the build (the compiled code would be stale:
  a warning names the file; ``make compiled`` rebuilds).

All or nothing: the compiled modules call each other natively through one shared
library, so a mix of compiled and pure modules of one group is never loaded.
:data:`BUILD` says which build this process runs (``kvsvc serve`` prints it and exports
it as the ``kvsvc_build_info`` metric).

Code in compiled modules follows mypyc's rules: declared attribute types are enforced at
run time, classes cannot be monkeypatched, and ``cls.__new__`` is not available.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

PURE_ENV = "KVSVC_PURE_PYTHON"
COMPILED_DIR_NAME = "_compiled"
MANIFEST_NAME = "manifest.json"
PACKAGE_ROOT = Path(__file__).resolve().parent
COMPILED_DIR = PACKAGE_ROOT / COMPILED_DIR_NAME

#: "mypyc" when the compiled modules are in use, else "pure".
BUILD = "pure"
#: Why this build: "compiled modules loaded", "KVSVC_PURE_PYTHON=1", "not built", ...
BUILD_REASON = "not installed"
#: The module names the compiled build replaces (empty on the pure build).
COMPILED_MODULES: frozenset[str] = frozenset()


def source_digest(path: Path) -> str:
    """SHA-256 of a source file (what the manifest records and the loader compares)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds the compiled extension module for each name it was given, and nothing else."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def _extension_files(folder: Path) -> dict[str, Path]:
    """Module name -> extension file for every extension module under ``folder``."""
    files: dict[str, Path] = {}
    for file in sorted(folder.rglob("*")):
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # longest (most specific) first
            if file.name.endswith(suffix):
                relative = file.relative_to(folder).as_posix()[: -len(suffix)]
                files[relative.replace("/", ".")] = file
                break
    return files


def _stale_sources(manifest: dict[str, object]) -> list[str]:
    sources = manifest.get("sources")
    if not isinstance(sources, dict):
        return ["(manifest lists no sources)"]
    stale = []
    for name, digest in sources.items():
        path = PACKAGE_ROOT.parent / name
        if not path.is_file() or source_digest(path) != digest:
            stale.append(name)
    return stale


def _choose() -> tuple[str, dict[str, Path]]:
    """Why this process runs which build, and the compiled files it loads (if any)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return f"{PURE_ENV}={os.environ[PURE_ENV]}", {}
    manifest_path = COMPILED_DIR / MANIFEST_NAME
    if not manifest_path.is_file():
        return "not built (python -m kvsvc.tools.compile_core builds it)", {}
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("python") != sys.implementation.cache_tag:
        return f"built for {manifest.get('python')}, not {sys.implementation.cache_tag}", {}
    stale = _stale_sources(manifest)
    if stale:
        warnings.warn(
            f"kvsvc: the compiled core is older than {', '.join(stale)}: running the "
            "pure-Python modules (make compiled rebuilds it)",
            RuntimeWarning,
            stacklevel=3,
        )
        return f"stale ({', '.join(stale)} changed since the build)", {}
    files = _extension_files(COMPILED_DIR)
    if not files:
        return "the compiled folder holds no extension modules", {}
    return "compiled modules loaded", files


def install() -> None:
    """Make the compiled modules importable ahead of the ``.py`` ones, where they apply.

    Runs once per process, before any compiled module is imported (``kvsvc/__init__``).
    """
    global BUILD, BUILD_REASON, COMPILED_MODULES
    if any(isinstance(finder, CompiledFinder) for finder in sys.meta_path):
        return
    reason, files = _choose()
    BUILD_REASON = reason
    if not files:
        BUILD = "pure"
        return
    sys.meta_path.insert(0, CompiledFinder(files))
    BUILD = "mypyc"
    COMPILED_MODULES = frozenset(name for name in files if "." in name)


def describe() -> str:
    """One line for logs: which build runs and why."""
    if BUILD == "mypyc":
        return f"core build: mypyc ({len(COMPILED_MODULES)} compiled modules)"
    return f"core build: pure Python ({BUILD_REASON})"
