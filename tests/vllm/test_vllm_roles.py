"""vLLM on a kvsvc server that requires role tokens: the scheduler talks as an engine, the
workers as agents, each with its own token from the environment (never from vLLM's config
or a command line), and the engine's requests live in its own namespace."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.integrations.vllm import vllm_kwargs
from tests.vllm.helpers import (
    environment,
    greedy_tokens,
    kvsvc_server,
    make_llm,
    release_llm,
    write_tiny_model,
)

pytestmark = pytest.mark.e2e

ENGINE_TOKEN = "vllm-engine-token-0123456789"
AGENT_TOKEN = "vllm-agent-token-0123456789"
ADMIN_TOKEN = "vllm-admin-token-0123456789"


def test_vllm_runs_with_an_engine_token_and_an_agent_token(tmp_path: Path) -> None:
    from kvsvc_client import ClientOptions, KVCacheClient

    (tmp_path / "engine").write_text(f"vllm-a {ENGINE_TOKEN}\n")
    (tmp_path / "agent").write_text(f"{AGENT_TOKEN}\n")
    (tmp_path / "admin").write_text(f"{ADMIN_TOKEN}\n")
    model_dir = write_tiny_model(tmp_path / "tiny")
    with kvsvc_server(
        "--engine-token-file",
        str(tmp_path / "engine"),
        "--agent-token-file",
        str(tmp_path / "agent"),
        "--admin-token-file",
        str(tmp_path / "admin"),
        "--max-model-len",
        "512",
        log_level="INFO",
    ) as server:
        with environment(KVSVC_ENGINE_TOKEN=ENGINE_TOKEN, KVSVC_AGENT_TOKEN=AGENT_TOKEN):
            kwargs = vllm_kwargs(server.address, "vllm")
            assert "auth_token" not in kwargs["additional_config"]["kvsvc"]
            llm = make_llm(model_dir, **kwargs)
            try:
                out = greedy_tokens(llm, [list(range(10, 90)), list(range(10, 70))], 8)
            finally:
                release_llm(llm)
        assert [len(t) for t in out] == [8, 8]
        options = ClientOptions(token=ADMIN_TOKEN, role="admin")
        with KVCacheClient(server.address, pool="vllm", options=options) as admin:
            usage = admin.usage()
            assert usage.num_requests == 0 and usage.num_free_blocks == usage.num_blocks
            assert usage.prefix_cache_hits > 0  # the second prompt hit the first's blocks
        assert "auth refused" not in server.output()
