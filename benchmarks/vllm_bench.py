"""Stock vLLM against vLLM on kvsvc: the same prompts, the same run, interleaved rounds.

Two in-process engines of the tiny dummy-weight Llama (CPU) run the same greedy workload
in alternating rounds, so both see the same machine speed. Printed per engine: output
tokens/s (median over rounds) and their ratio; for kvsvc also RPCs per scheduling step
(median, max; decode-only steps apart), and the time the scheduler waited on kvsvc per
step. Goals (issue "A real engine on kvsvc"): tokens/s ratio >= 0.95, <= 2 RPCs in
decode-only steps.

Run: ``make bench-vllm`` (or ``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python
benchmarks/vllm_bench.py [--rounds N] [--requests N]``).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsvc.integrations.vllm import vllm_kwargs
from tests.vllm.helpers import (
    VLLM_ENV,
    engine_args,
    engine_core,
    kvsvc_server,
    write_tiny_model,
)


def workload(num_requests: int, seed: int = 0) -> list[list[int]]:
    """Chat-like prompts: a shared system prefix, a few shared documents, a distinct tail."""
    rng = random.Random(seed)
    system = [rng.randrange(8192) for _ in range(64)]
    documents = [[rng.randrange(8192) for _ in range(96)] for _ in range(4)]
    prompts = []
    for i in range(num_requests):
        tail = [rng.randrange(8192) for _ in range(rng.randrange(8, 48))]
        prompts.append(system + documents[i % len(documents)] + tail)
    return prompts


def one_round(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds per engine")
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    parser.add_argument("--blocks", type=int, default=256, help="KV cache blocks (32 tokens)")
    args = parser.parse_args()
    os.environ.update(VLLM_ENV)
    import vllm

    prompts = workload(args.requests)
    with (
        tempfile.TemporaryDirectory() as tmp,
        kvsvc_server(
            "--num-gpu-blocks-override", str(args.blocks), "--max-model-len", "512"
        ) as server,
    ):
        model = write_tiny_model(Path(tmp))
        stock = vllm.LLM(**engine_args(model, num_gpu_blocks_override=args.blocks))
        on_kvsvc = vllm.LLM(**engine_args(model, **vllm_kwargs(server.address, server.pool)))
        mirror = engine_core(on_kvsvc).scheduler.kvsvc
        # Warm both (first-run compilation, allocator), then reset the manager's counters.
        for _ in range(2):
            one_round(stock, prompts, args.max_tokens)
            one_round(on_kvsvc, prompts, args.max_tokens)
        stats = mirror.stats
        stats.rpcs_by_step.clear()
        stats.seconds_waiting = 0.0
        stats.sync_calls = 0
        steps_before = len(stats.rpcs_by_step)
        rates: dict[str, list[float]] = {"stock": [], "kvsvc": []}
        decode_rpcs: list[int] = []
        order = [("stock", stock), ("kvsvc", on_kvsvc)]
        for _ in range(args.rounds):
            order.reverse()  # neither engine always runs first
            for name, llm in order:
                mark = len(stats.rpcs_by_step)
                elapsed, tokens = one_round(llm, prompts, args.max_tokens)
                rates[name].append(tokens / elapsed)
                if name == "kvsvc":
                    # Steps after the last admission of the round are decode-only; the
                    # first len(prompts) steps may admit.
                    decode_rpcs.extend(stats.rpcs_by_step[mark + args.requests :])
        steps = stats.rpcs_by_step[steps_before:]
        stock_rate = statistics.median(rates["stock"])
        kvsvc_rate = statistics.median(rates["kvsvc"])
        wait_per_step_us = 1e6 * stats.seconds_waiting / max(len(steps), 1)
        rows = [
            ("output tokens/s, stock vLLM (median)", f"{stock_rate:,.0f}"),
            ("output tokens/s, vLLM on kvsvc (median)", f"{kvsvc_rate:,.0f}"),
            ("ratio kvsvc / stock (goal >= 0.95)", f"{kvsvc_rate / stock_rate:.3f}"),
            ("tokens/s per round, stock", " ".join(f"{r:,.0f}" for r in rates["stock"])),
            ("tokens/s per round, kvsvc", " ".join(f"{r:,.0f}" for r in rates["kvsvc"])),
            (
                "per-round ratios",
                " ".join(
                    f"{k / s:.2f}" for k, s in zip(rates["kvsvc"], rates["stock"], strict=True)
                ),
            ),
            (
                "RPCs per step, all steps (median / max)",
                f"{statistics.median(steps):g} / {max(steps)}",
            ),
            (
                "RPCs per step, decode-only (median / max; goal <= 2)",
                f"{statistics.median(decode_rpcs):g} / {max(decode_rpcs)}" if decode_rpcs else "-",
            ),
            ("synchronous calls (admission lookups, refreshes)", f"{stats.sync_calls}"),
            ("time waiting on kvsvc per step (mean, us)", f"{wait_per_step_us:.0f}"),
            ("steps measured", f"{len(steps)}"),
        ]
        width = max(len(label) for label, _ in rows)
        print(
            f"vLLM {vllm.__version__} on CPU, {args.requests} requests x {args.max_tokens} "
            f"tokens, {args.rounds} interleaved rounds, {args.blocks} blocks"
        )
        for label, value in rows:
            print(f"{label:<{width}}  {value}")
        for llm in (stock, on_kvsvc):
            llm.llm_engine.engine_core.shutdown()
        del stock, on_kvsvc, llm
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
