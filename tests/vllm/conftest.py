"""The vLLM integration tests: they run only where vLLM is installed (``make test`` builds
``.venv-vllm`` for them); elsewhere the whole directory is skipped with the reason."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test runs these in .venv-vllm)")
