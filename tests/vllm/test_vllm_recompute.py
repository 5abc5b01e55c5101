"""A forced reset of the pool under a running vLLM: the engine preempts and recomputes.

An operator's ``ForceResetPrefixCache`` (or a rank that came back with fresh tensors)
flags every live request of the pool RECOMPUTE. vLLM on kvsvc learns it from the next
Step's reply and does what vLLM does when it resets its prefix cache with requests
running: it preempts them all and admits them again with their tokens so far. The engine
goes on (it used to stop with an error), every request ends with the same greedy tokens
as stock vLLM, and the pool ends with every block back. A forced reset of an idle
engine's pool (no request flagged, only the prefix index emptied) is resynchronised too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.integrations.vllm import vllm_kwargs
from tests.vllm.helpers import (
    POOL,
    engine_core,
    greedy_tokens,
    kvsvc_server,
    make_llm,
    release_llm,
    write_tiny_model,
)

pytestmark = pytest.mark.e2e

PROMPTS = [[7, 8, 9] * 20 + list(range(100 + i, 140 + i)) for i in range(4)]
MAX_TOKENS = 24


def test_a_forced_reset_mid_generation_is_recomputed_with_stocks_tokens(tmp_path: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = write_tiny_model(tmp_path / "tiny")
    llm = make_llm(model_dir)
    try:
        expected = greedy_tokens(llm, PROMPTS, MAX_TOKENS)
    finally:
        release_llm(llm)

    with kvsvc_server("--max-model-len", "512") as server:
        llm = make_llm(model_dir, **vllm_kwargs(server.address, POOL))
        try:
            engine = llm.llm_engine
            params = SamplingParams(
                temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True
            )
            for i, prompt in enumerate(PROMPTS):
                engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
            outputs: dict[str, list[int]] = {}
            steps = 0
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        outputs[output.request_id] = list(output.outputs[0].token_ids)
                steps += 1
                if steps == 6:
                    with server.client() as admin:
                        flagged, _ = admin.force_reset_prefix_cache()
                    assert flagged == len(PROMPTS)
            replica = engine_core(llm).scheduler.kvsvc
            assert replica.stats.resyncs == 1
            assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
        finally:
            release_llm(llm)
        with server.client() as kv:
            usage = kv.usage()
            assert usage.num_requests == 0 and usage.num_free_blocks == usage.num_blocks


def test_a_forced_reset_of_an_idle_engine_s_pool_is_resynced(tmp_path: Path) -> None:
    """With nothing running, a forced reset flags no request: it only empties the pool's
    prefix index, behind the replica that still holds it. The next request's Step then
    answers otherwise than the replica predicted; the pool's invalidation count says why,
    so the engine resynchronises as for flagged requests (it used to stop with "the
    server diverged") and goes on with the same tokens, caching and hitting again."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = write_tiny_model(tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=4, detokenize=False, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=PROMPTS[0])
    with kvsvc_server("--max-model-len", "512") as server:
        llm = make_llm(model_dir, **vllm_kwargs(server.address, POOL))
        try:
            replica = engine_core(llm).scheduler.kvsvc
            first = llm.generate([prompt], params, use_tqdm=False)[0]
            with server.client() as admin:
                flagged, dropped = admin.force_reset_prefix_cache()
                assert admin.usage().num_invalidations == 1
            assert flagged == 0 and dropped > 0
            again = llm.generate([prompt], params, use_tqdm=False)[0]
            assert replica.stats.resyncs == 1
            assert again.outputs[0].token_ids == first.outputs[0].token_ids
            third = llm.generate([prompt], params, use_tqdm=False)[0]
            assert third.num_cached_tokens > 0  # cached again after the resync, and hit
            assert third.outputs[0].token_ids == first.outputs[0].token_ids
            assert replica.stats.resyncs == 1
        finally:
            release_llm(llm)
        with server.client() as kv:
            usage = kv.usage()
            assert usage.num_requests == 0 and usage.num_free_blocks == usage.num_blocks
