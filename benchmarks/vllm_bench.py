"""Stock vLLM against vLLM on kvsvc: the same prompts, the same run, interleaved rounds.

Per model (the tiny dummy-weight Llama, dense, and the tiny Gemma 3, hybrid: a
sliding-window and a full-attention group), three in-process engines (CPU) run the same
greedy workload in rotating rounds, so all see the same machine speed: stock vLLM, vLLM on
kvsvc over gRPC, and vLLM on kvsvc with its scheduler's calls over the framed transport (a
Unix socket: the sidecar case); each kvsvc engine has its own server and pool. Printed per
engine: output tokens/s (median over rounds) and the ratio to stock; for kvsvc also RPCs
per scheduling step (median, max; decode-only steps apart), and the time the scheduler
waited on kvsvc per step. Goals: tokens/s ratio >= 0.95 over frames and >= 0.90 over
gRPC for both models, <= 1 RPC in decode-only steps.

Both builds of the core (kvsvc.native): where the compiled build is there, two more
engines run on servers with the pure-Python core (``KVSVC_PURE_PYTHON=1``), gRPC and
frames, in the same rounds (``--no-pure`` skips them). The engines themselves (this
process, whose replica of the pool runs the core) run the compiled build either way.

Run: ``make bench-vllm`` (or ``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python
benchmarks/vllm_bench.py [--models llama,gemma3] [--rounds N] [--requests N]``).
"""

from __future__ import annotations

import argparse
import contextlib
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

from kvsvc import native
from kvsvc.integrations.vllm import vllm_kwargs
from tests.vllm.helpers import VLLM_ENV, engine_args, engine_core, kvsvc_server
from tests.vllm.models import MODELS, write_model


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
    parser.add_argument(
        "--models",
        default="llama,gemma3",
        help=f"comma-separated tiny models to run, of: {', '.join(MODELS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--no-pure", action="store_true", help="no engines on servers with the pure-Python core"
    )
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    os.environ.update(VLLM_ENV)
    import vllm

    print(
        f"vLLM {vllm.__version__} on CPU, {args.requests} requests x {args.max_tokens} "
        f"tokens, {args.rounds} interleaved rounds, {args.blocks} blocks"
    )
    for model in models:
        rows = bench_model(vllm, model, args)
        width = max(len(label) for label, _ in rows)
        print(f"\n== {model}")
        for label, value in rows:
            print(f"{label:<{width}}  {value}".rstrip())
    return 0


def bench_model(vllm: Any, model_name: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Stock vLLM and vLLM on kvsvc (gRPC, frames) on one model: the report's rows."""
    prompts = workload(args.requests)
    server_args = ("--num-gpu-blocks-override", str(args.blocks), "--max-model-len", "512")
    with_pure = native.BUILD == "mypyc" and not args.no_pure
    builds = {"": None, "_pure": {native.PURE_ENV: "1"}} if with_pure else {"": None}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = write_model(model_name, Path(tmp))
        engines = {
            "stock": vllm.LLM(**engine_args(model, num_gpu_blocks_override=args.blocks)),
        }
        for tag, env in builds.items():
            server = stack.enter_context(kvsvc_server(*server_args, env=env))
            frames_server = stack.enter_context(
                kvsvc_server(*server_args, pool="vllm-frames", frames=True, env=env)
            )
            engines[f"kvsvc{tag}"] = vllm.LLM(
                **engine_args(model, **vllm_kwargs(server.address, server.pool))
            )
            engines[f"kvsvc_frames{tag}"] = vllm.LLM(
                **engine_args(
                    model,
                    **vllm_kwargs(
                        frames_server.address, frames_server.pool, frames=frames_server.frames
                    ),
                )
            )
        on_kvsvc = tuple(name for name in engines if name != "stock")
        stats = {name: engine_core(engines[name]).scheduler.kvsvc.stats for name in on_kvsvc}
        # Warm every engine (first-run compilation, allocator), then reset the counters.
        for _ in range(2):
            for llm in engines.values():
                one_round(llm, prompts, args.max_tokens)
        for counters in stats.values():
            counters.rpcs_by_step.clear()
            counters.seconds_waiting = 0.0
            counters.sync_calls = 0
        rates: dict[str, list[float]] = {name: [] for name in engines}
        decode_rpcs: dict[str, list[int]] = {name: [] for name in on_kvsvc}
        order = list(engines)
        for _ in range(args.rounds):
            order = order[1:] + order[:1]  # no engine always runs first
            for name in order:
                counters = stats.get(name)
                mark = len(counters.rpcs_by_step) if counters is not None else 0
                elapsed, tokens = one_round(engines[name], prompts, args.max_tokens)
                rates[name].append(tokens / elapsed)
                if counters is not None:
                    # Steps after the last admission of the round are decode-only; the
                    # first len(prompts) steps may admit.
                    decode_rpcs[name].extend(counters.rpcs_by_step[mark + args.requests :])
        stock_rate = statistics.median(rates["stock"])
        rows = [
            ("output tokens/s, stock vLLM (median)", f"{stock_rate:,.0f}"),
            ("tokens/s per round, stock", " ".join(f"{r:,.0f}" for r in rates["stock"])),
        ]
        labels = {
            "kvsvc": ("gRPC", "0.90"),
            "kvsvc_frames": ("frames, Unix socket", "0.95"),
            "kvsvc_pure": ("gRPC, server with the pure-Python core", "0.90"),
            "kvsvc_frames_pure": ("frames, Unix socket, server with the pure-Python core", "0.95"),
        }

        def wait_per_step_us(name: str) -> float:
            counters = stats[name]
            return 1e6 * counters.seconds_waiting / max(len(counters.rpcs_by_step), 1)

        for name in on_kvsvc:
            label, goal = labels[name]
            counters = stats[name]
            steps = counters.rpcs_by_step
            rate = statistics.median(rates[name])
            decode = decode_rpcs[name]
            rows += [
                (f"vLLM on kvsvc, {label}:", ""),
                ("  output tokens/s (median)", f"{rate:,.0f}"),
                (f"  ratio to stock (goal >= {goal})", f"{rate / stock_rate:.3f}"),
                ("  tokens/s per round", " ".join(f"{r:,.0f}" for r in rates[name])),
                (
                    "  per-round ratios",
                    " ".join(
                        f"{k / s:.2f}" for k, s in zip(rates[name], rates["stock"], strict=True)
                    ),
                ),
                (
                    "  RPCs per step, all steps (median / max)",
                    f"{statistics.median(steps):g} / {max(steps)}",
                ),
                (
                    "  RPCs per step, decode-only (median / max; goal <= 1)",
                    f"{statistics.median(decode):g} / {max(decode)}" if decode else "-",
                ),
                ("  synchronous calls (resyncs)", f"{counters.sync_calls}"),
                ("  time waiting on kvsvc per step (mean, us)", f"{wait_per_step_us(name):.0f}"),
                ("  steps measured", f"{len(steps)}"),
            ]
            if name.endswith("_pure"):
                compiled = name.removesuffix("_pure")
                rows.append(
                    (
                        "  waiting per step vs the compiled core's server",
                        f"{wait_per_step_us(name) / max(wait_per_step_us(compiled), 1e-9):.2f}x",
                    )
                )
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
        engines.clear()
        gc.collect()
    return rows


if __name__ == "__main__":
    sys.exit(main())
