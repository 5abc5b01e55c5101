"""The vLLM integration tests run only where vLLM is installed: ``make test`` builds
``.venv-vllm`` and runs this directory there. Elsewhere nothing here is collected."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
