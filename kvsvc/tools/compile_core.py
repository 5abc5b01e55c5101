"""Build kvsvc's compiled core: the modules :data:`COMPILED` names, compiled by mypyc.

The extension modules go to ``kvsvc/_compiled/`` (see :mod:`kvsvc.native`), not beside the
``.py`` files: there CPython's import system would always take them first, and the
pure-Python build (``KVSVC_PURE_PYTHON=1``) could not run from the same tree. The manifest
written with them records each source's SHA-256, so a source edited after the build makes
the loader fall back to the pure modules (with a warning) instead of running stale code.

Needs mypy (the dev extra; mypyc ships with it), setuptools and a C compiler.
``python -m kvsvc.tools.compile_core`` builds. Without a C compiler it says so in one line
and exits 0 (the pure build runs), or 1 with ``CI=true`` (where the compiled build must be
the one tested).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# What is compiled: globs relative to the repository root, the one place that says so. Every
# module here must stay mypyc-compatible (see kvsvc.native); package __init__ files stay
# Python (kvsvc/core/__init__.py only re-exports).
COMPILED = (
    "kvsvc/core/*.py",
    "kvsvc/server/step.py",
    "kvsvc/server/step_codec.py",
    "kvsvc/server/wire.py",
)
NOT_COMPILED = ("__init__.py",)
# The shared library of the group (one for all modules: calls between them stay native).
GROUP = "kvsvc_native"


def compiled_sources(root: Path = REPO_ROOT) -> list[Path]:
    """The source files :data:`COMPILED` selects, relative to ``root``, sorted."""
    found = {
        path.relative_to(root)
        for pattern in COMPILED
        for path in root.glob(pattern)
        if path.name not in NOT_COMPILED
    }
    return sorted(found)


def c_compiler() -> str | None:
    """The C compiler setuptools would use (``CC`` or Python's own), or None if absent."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shutil.which(cc.split()[0])


def manifest_for(sources: list[Path], root: Path = REPO_ROOT) -> dict[str, object]:
    """What a build of ``sources`` records (and what an up-to-date build already holds)."""
    from kvsvc.native import source_digest

    return {
        "builder": source_digest(Path(__file__)),  # a changed build recipe rebuilds too
        "group": GROUP,
        "python": sys.implementation.cache_tag,
        "sources": {str(path): source_digest(root / path) for path in sources},
    }


def up_to_date(root: Path = REPO_ROOT) -> bool:
    """Whether ``kvsvc/_compiled`` holds a build of exactly today's selected sources."""
    from kvsvc.native import COMPILED_DIR_NAME, MANIFEST_NAME

    path = root / "kvsvc" / COMPILED_DIR_NAME / MANIFEST_NAME
    if not path.is_file():
        return False
    built: dict[str, object] = json.loads(path.read_text())
    return built == manifest_for(compiled_sources(root), root)


def build(root: Path = REPO_ROOT, verbose: bool = False) -> Path:
    """Compile :func:`compiled_sources` into ``root/kvsvc/_compiled``; return that folder.

    The folder is replaced whole only once the build succeeded (a failed build leaves the
    previous one, or none).
    """
    from mypyc.build import mypycify  # the dev extra
    from setuptools import Distribution

    from kvsvc.native import COMPILED_DIR_NAME, MANIFEST_NAME

    sources = compiled_sources(root)
    if not sources:
        raise SystemExit(f"nothing to compile: no files match {COMPILED} under {root}")
    out = root / "kvsvc" / COMPILED_DIR_NAME
    with tempfile.TemporaryDirectory(prefix="kvsvc-mypyc-") as scratch:
        previous = Path.cwd()
        os.chdir(root)  # mypyc names modules by their paths relative to the working directory
        try:
            extensions = mypycify(
                [str(path) for path in sources],
                opt_level="3",
                group_name=GROUP,
                target_dir=str(Path(scratch) / "c"),
                verbose=verbose,
            )
            staging = Path(scratch) / "lib"
            dist = Distribution({"name": "kvsvc-compiled", "ext_modules": extensions})
            dist.script_args = [
                "build_ext",
                "--build-lib",
                str(staging),
                "--build-temp",
                str(Path(scratch) / "tmp"),
            ]
            dist.parse_command_line()
            dist.run_commands()
        finally:
            os.chdir(previous)
        manifest = manifest_for(sources, root)
        (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        (staging / "README").write_text(
            "Built by `python -m kvsvc.tools.compile_core` (make venv); not in git.\n"
        )
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staging, out)
    return out


# What the first build takes on two cores (measured: 1 min 36 s and 1 min 45 s from fresh
# clones), as `make venv` announces it and README and docs/install.md say.
FIRST_BUILD_MINUTES = "1.5-2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument(
        "--force", action="store_true", help="build even where the build is up to date"
    )
    args = parser.parse_args(argv)
    if c_compiler() is None:
        print(
            "notice: no C compiler found (CC or cc): the core stays pure Python "
            "(install gcc, then make compiled)"
        )
        return 1 if os.environ.get("CI", "").lower() in ("1", "true", "yes") else 0
    sources = compiled_sources()
    if not args.force and up_to_date():
        print(f"the compiled core is up to date ({len(sources)} modules, kvsvc/_compiled/)")
        return 0
    # Before the build, which prints nothing for a minute or two.
    print(
        f"compiling {len(sources)} modules with mypyc into kvsvc/_compiled/ (the first time "
        f"~{FIRST_BUILD_MINUTES} min on two cores; again only after one of them changes)",
        flush=True,
    )
    out = build(verbose=args.verbose)
    print(f"compiled {len(sources)} modules with mypyc into {out.relative_to(REPO_ROOT)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
