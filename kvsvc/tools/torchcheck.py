"""Is the torch ``make venv`` installed the build it asked for?

::

    python -m kvsvc.tools.torchcheck TORCH_INDEX_URL

The Makefile installs torch from ``TORCH_INDEX_URL`` (the CPU build's index by default)
as an extra index. When that index cannot be reached, pip retries it for a while and then
quietly takes PyPI's own ``torch``: a CUDA build that pulls several GB of ``nvidia-*``
packages, on a machine that asked for the CPU one. This check runs right after the
install (from the repository root, before kvsvc itself is installed: it needs nothing but
torch) and stops ``make venv`` with what to set instead.

The build asked for: ``+cuNNN`` (or ``+rocmX.Y``) when the index is one of those builds'
(``.../whl/cu128``), ``+cpu`` otherwise.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_INDEX_EXAMPLE = "https://download.pytorch.org/whl/cu128"


def build_asked_for(index_url: str) -> str:
    """The local version label of the torch ``index_url`` serves: ``cpu``, ``cu128``, ..."""
    match = re.search(r"/(cu\d+|rocm[\d.]+)/*$", index_url)
    return match.group(1) if match else "cpu"


def problem(installed: str, index_url: str) -> str | None:
    """What is wrong with torch ``installed`` (its ``__version__``), or None."""
    wanted = build_asked_for(index_url)
    _, _, build = installed.partition("+")
    if build == wanted:
        return None
    got = f"the +{build} build" if build else "PyPI's build (a CUDA one, with nvidia-* packages)"
    return (
        f"torch {installed} is installed, not the +{wanted} build asked for: pip took "
        f"{got}, which means it could not reach TORCH_INDEX_URL ({index_url}) or found "
        f"another torch first. Set TORCH_INDEX_URL to a torch index this machine reaches "
        f"(the default is {CPU_INDEX}; on a GPU machine the CUDA your driver runs, e.g. "
        f"{CUDA_INDEX_EXAMPLE}), or PIP_FIND_LINKS to a directory holding the torch "
        f"+{wanted} wheel; then `make clean` and run make again."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m kvsvc.tools.torchcheck TORCH_INDEX_URL", file=sys.stderr)
        return 2
    import warnings

    with warnings.catch_warnings():
        # The check runs before the venv has numpy (kvsvc's own install, the next step,
        # brings it): torch then warns "Failed to initialize NumPy" at import, noise in the
        # middle of `make venv` about a module that arrives a minute later.
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch

    error = problem(str(torch.__version__), args[0])
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"   torch {torch.__version__}: the build asked for")
    return 0


if __name__ == "__main__":
    sys.exit(main())
