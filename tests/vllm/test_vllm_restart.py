"""vLLM and a kvsvc server that restart apart from each other.

A kvsvc server restarted on its state under a live engine: the engine's workers come back
naming the same tensors, so the pool keeps what they cached and the next request hits it.

vLLM started again on a pool whose previous engine died with requests live.

The kvsvc server outlives the engine (a sidecar, here with its state kept on disk, so a
server restart would bring those requests back too). The dead engine's requests hold
blocks; the new engine's workers take the ranks with fresh tensors, so the server flags
them (their KV data is gone) and the new engine's manager frees them at start, where it
used to refuse to start ("holds N live requests of another engine"). The new engine
then serves the same greedy tokens as an engine on an empty pool, and the pool ends with
every block back.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvsvc.integrations.vllm import vllm_kwargs
from tests.tooling import free_port
from tests.vllm.helpers import (
    BLOCK_SIZE,
    POOL,
    greedy_tokens,
    kvsvc_server,
    make_llm,
    release_llm,
    write_tiny_model,
)

pytestmark = pytest.mark.e2e

PROMPTS = [list(range(10 + i, 90 + i)) for i in range(3)]


def test_vllm_started_again_frees_what_the_dead_engine_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = write_tiny_model(tmp_path / "tiny")
    with kvsvc_server("--max-model-len", "512", "--state-dir", str(tmp_path / "state")) as server:
        kwargs = vllm_kwargs(server.address, POOL)
        llm = make_llm(model_dir, **kwargs)
        try:
            expected = greedy_tokens(llm, PROMPTS, 8)  # on an empty pool
            engine = llm.llm_engine
            params = SamplingParams(
                temperature=0, max_tokens=200, detokenize=False, ignore_eos=True
            )
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(f"cut-{i}", TokensPrompt(prompt_token_ids=prompt), params)
            for _ in range(4):
                engine.step()
        finally:
            release_llm(llm)  # the engine is gone; its three requests are not finished
        with server.client() as kv:
            usage = kv.usage()
            assert usage.num_requests == len(PROMPTS)
            assert usage.num_free_blocks < usage.num_blocks

        with caplog.at_level(logging.WARNING, logger="kvsvc.integrations.vllm.manager"):
            llm = make_llm(model_dir, **kwargs)
        try:
            assert f"freed {len(PROMPTS)} requests an earlier engine left live" in caplog.text
            # Nothing of the dead engine's is served as a hit: its tensors are gone.
            assert greedy_tokens(llm, PROMPTS, 8) == expected
        finally:
            release_llm(llm)
        with server.client() as kv:
            usage = kv.usage()
            assert usage.num_requests == 0 and usage.num_free_blocks == usage.num_blocks


def test_a_server_restarted_under_a_live_engine_keeps_its_cached_blocks(tmp_path: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = write_tiny_model(tmp_path / "tiny")
    address = f"127.0.0.1:{free_port()}"  # the restarted server listens where the first did
    serve = ("--max-model-len", "512", "--state-dir", str(tmp_path / "state"))
    prompt = TokensPrompt(prompt_token_ids=list(range(200, 200 + 2 * BLOCK_SIZE + 16)))
    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False, ignore_eos=True)
    with kvsvc_server(*serve, listen=address) as server:
        llm = make_llm(model_dir, **vllm_kwargs(server.address, POOL))
        try:
            first = llm.generate([prompt], params, use_tqdm=False)[0]
            assert first.num_cached_tokens == 0
        except BaseException:
            release_llm(llm)
            raise
    # The server has gone (stopped, its state on disk); the engine and its tensors stay.
    with kvsvc_server(*serve, listen=address) as server:
        try:
            with server.client() as kv:
                kv.wait_until_ready(timeout=60)  # the engine's worker registered again
                usage = kv.usage()
            again = llm.generate([prompt], params, use_tqdm=False)[0]
            # The worker named the same tensors: the blocks the first request cached are
            # still there to hit (a new identity would have had the server drop them).
            assert usage.num_cached_blocks == 2
            assert again.num_cached_tokens == 2 * BLOCK_SIZE
            assert again.outputs[0].token_ids == first.outputs[0].token_ids
        finally:
            release_llm(llm)
