"""The vLLM integration tests run only where vLLM is installed: ``make test`` builds
``.venv-vllm`` and runs this directory there. Elsewhere nothing here is collected.

(This directory is no package on purpose: an ``__init__.py`` here would make ``tests/vllm``
importable as ``vllm`` and hide the real one. For the same reason the check below ignores
a namespace-package match, which is this directory seen from ``tests/``.)
"""

from __future__ import annotations

import importlib.util

_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["test_*.py"]
