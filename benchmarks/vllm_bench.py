"""Stock vLLM against vLLM on kvsvc: the same prompts, the same run, interleaved rounds.

Per model (the tiny dummy-weight Llama, dense, and the tiny Gemma 3, hybrid: a
sliding-window and a full-attention group), in-process engines (CPU) run the same greedy
workload in rotating rounds: stock vLLM, vLLM on kvsvc over gRPC, and vLLM on kvsvc with
its scheduler's calls over the framed transport (a Unix socket: the sidecar case), its
Steps sent by the client's sender thread (the default) and, a fourth, sent and read on
the scheduler's thread (``step_sender="inline"``); then "steps held", over gRPC and over
frames: the default settings but ``steps_per_call`` (``--steps-per-call``, default 4), the
operations of steps that admit nothing held for a later step's call. Each kvsvc engine
has its own server and pool.

Wall-clock tokens/s alone says little on a shared machine (stock's own rounds have ranged
17x), so each engine's rounds also measure what another process's load touches less
(benchmarks/engine_figures.py): the scheduler thread's CPU time per step around
``schedule()`` and ``update_from_output()``, split into the KV cache manager's methods,
kvsvc's sending and awaiting of Steps, and the rest (vLLM's own scheduling); the wall
time it waited on kvsvc; the CPU of kvsvc's Step sender thread; and the CPU time per output
token of this process (and of it, its main thread's, which runs the forward pass too, and
that of the threads Python did not start, torch's above all) and of the kvsvc server.
Rounds run one engine at a time, so a round's process CPU is its engine's. Printed: per
figure and engine, the median with min-max over rounds, and each round's ratio to stock's
round in the same rotation (median, min-max); NOISY when stock's rounds differ by more
than 2x in tokens/s. Then RPCs per scheduling step (decode-only steps apart) and resyncs.

Goals (issue 33): scheduler thread CPU per step on kvsvc <= 1.0x stock; tokens/s >= 0.95x
stock over frames and >= 0.90x over gRPC; <= 1 RPC in decode-only steps.

Both builds of the core (kvsvc.native): where the compiled build is there, two more
engines run on servers with the pure-Python core (``KVSVC_PURE_PYTHON=1``), gRPC and
frames, in the same rounds (``--no-pure`` skips them; they have no goals). The engines
themselves (this process, whose replica of the pool runs the core) run the compiled build
either way.

Run: ``make bench-vllm`` (or ``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python
benchmarks/vllm_bench.py [--models llama,gemma3] [--rounds N] [--requests N] [--no-pure]``).
Linux only (a thread's CPU clock, ``/proc/PID/task``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from benchmarks.engine_figures import (
    Reading,
    RoundFigures,
    SchedulerMeter,
    process_cpu_s,
    public_methods,
    render,
    round_figures,
    thread_cpu_split,
)
from kvsvc import native
from kvsvc.integrations.vllm import vllm_kwargs
from kvsvc.integrations.vllm.config import MAX_STEPS_PER_CALL
from tests.vllm.helpers import VLLM_ENV, engine_args, engine_core, kvsvc_server
from tests.vllm.models import MODELS, write_model

# The engines' names in the table; the goals (benchmarks/engine_figures.py) are keyed by them.
LABELS = {
    "stock": "stock",
    "kvsvc": "gRPC",
    "kvsvc_frames": "frames",
    "kvsvc_frames_inline": "frames, inline Steps",
    "kvsvc_held": "gRPC, steps held",
    "kvsvc_frames_held": "frames, steps held",
    "kvsvc_pure": "gRPC, pure-Python server",
    "kvsvc_frames_pure": "frames, pure-Python server",
}

# What kvsvc's scheduler calls on its pool replica around vLLM's step, outside the
# manager's methods: wait for the previous Step's reply, send this step's Step, and (idle)
# send the frees and wait.
STEP_METHODS = ("await_reply", "end_step", "flush")


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
        "--steps-per-call",
        type=int,
        default=4,
        help="steps_per_call of the 'steps held' engines, gRPC and frames (1: none run; "
        "default %(default)s)",
    )
    parser.add_argument(
        "--no-pure", action="store_true", help="no engines on servers with the pure-Python core"
    )
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    if not 1 <= args.steps_per_call <= MAX_STEPS_PER_CALL:
        parser.error(f"--steps-per-call must be from 1 to {MAX_STEPS_PER_CALL}")
    os.environ.update(VLLM_ENV)
    import vllm

    print(
        f"vLLM {vllm.__version__} on CPU, {args.requests} requests x {args.max_tokens} "
        f"tokens, {args.rounds} interleaved rounds, {args.blocks} blocks; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs at the start"
        + (
            f"; 'steps held': steps_per_call={args.steps_per_call}"
            if args.steps_per_call > 1
            else ""
        )
    )
    for model in models:
        lines = bench_model(vllm, model, args)
        print(f"\n== {model}")
        print("\n".join(lines))
    return 0


def bench_model(vllm: Any, model_name: str, args: argparse.Namespace) -> list[str]:
    """Stock vLLM and vLLM on kvsvc (gRPC, frames) on one model: the report's lines."""
    prompts = workload(args.requests)
    server_args = ("--num-gpu-blocks-override", str(args.blocks), "--max-model-len", "512")
    with_pure = native.BUILD == "mypyc" and not args.no_pure
    builds = {"": None, "_pure": {native.PURE_ENV: "1"}} if with_pure else {"": None}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = write_model(model_name, Path(tmp))
        engines = {
            "stock": vllm.LLM(**engine_args(model, num_gpu_blocks_override=args.blocks)),
        }
        servers: dict[str, Any] = {}
        for tag, env in builds.items():
            server = stack.enter_context(kvsvc_server(*server_args, env=env))
            frames_server = stack.enter_context(
                kvsvc_server(*server_args, pool="vllm-frames", frames=True, env=env)
            )
            servers[f"kvsvc{tag}"] = server
            servers[f"kvsvc_frames{tag}"] = frames_server
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
            if not tag:
                # The framed Step sent and read on the scheduler's thread
                # (step_sender="inline") rather than by the client's sender thread (the
                # default): the same calls, the trade between the two threads' CPU.
                inline_server = stack.enter_context(
                    kvsvc_server(*server_args, pool="vllm-frames-inline", frames=True, env=env)
                )
                servers["kvsvc_frames_inline"] = inline_server
                engines["kvsvc_frames_inline"] = vllm.LLM(
                    **engine_args(
                        model,
                        **vllm_kwargs(
                            inline_server.address,
                            inline_server.pool,
                            frames=inline_server.frames,
                            step_sender="inline",
                        ),
                    )
                )
                if args.steps_per_call > 1:
                    # Steps that admit nothing held for later steps' calls (steps_per_call):
                    # fewer calls, the server's view up to steps_per_call - 1 steps behind.
                    for name, frames in (("kvsvc_held", False), ("kvsvc_frames_held", True)):
                        held_server = stack.enter_context(
                            kvsvc_server(*server_args, pool=f"vllm-{name}", frames=frames, env=env)
                        )
                        servers[name] = held_server
                        engines[name] = vllm.LLM(
                            **engine_args(
                                model,
                                **vllm_kwargs(
                                    held_server.address,
                                    held_server.pool,
                                    frames=held_server.frames,
                                    steps_per_call=args.steps_per_call,
                                ),
                            )
                        )
        on_kvsvc = tuple(name for name in engines if name != "stock")
        replicas = {name: engine_core(engines[name]).scheduler.kvsvc for name in on_kvsvc}
        meters = {name: SchedulerMeter() for name in engines}
        for name, meter in meters.items():
            scheduler = engine_core(engines[name]).scheduler
            meter.attach(scheduler)
            manager = scheduler.kv_cache_manager
            meter.attach_part("manager", manager, public_methods(manager))
            if name in replicas:
                meter.attach_part("steps", replicas[name], STEP_METHODS)
        # Warm every engine (first-run compilation, allocator, the Step sender threads).
        for _ in range(2):
            for llm in engines.values():
                one_round(llm, prompts, args.max_tokens)
        server_pids = {name: server.child.process.pid for name, server in servers.items()}

        def reading(name: str) -> Reading:
            meter = meters[name]
            replica = replicas.get(name)
            main_thread_s, native_threads_s = thread_cpu_split()
            base = Reading(
                meter.steps,
                meter.cpu_s,
                meter.wall_s,
                time.process_time(),
                manager_cpu_s=meter.parts["manager"],
                main_thread_cpu_s=main_thread_s,
                native_threads_cpu_s=native_threads_s,
            )
            if replica is None:
                return base
            return dataclasses.replace(
                base,
                steps_cpu_s=meter.parts["steps"],
                wait_s=replica.stats.seconds_waiting,
                sender_cpu_s=sender_cpu_s(replica),
                server_cpu_s=process_cpu_s(server_pids[name]),
            )

        for counters in (replica.stats for replica in replicas.values()):
            counters.rpcs_by_step.clear()
            counters.sync_calls = 0
        rounds: dict[str, list[RoundFigures]] = {name: [] for name in engines}
        decode_rpcs: dict[str, list[int]] = {name: [] for name in on_kvsvc}
        order = list(engines)
        for _ in range(args.rounds):
            order = order[1:] + order[:1]  # no engine always runs first
            for name in order:
                replica = replicas.get(name)
                mark = len(replica.stats.rpcs_by_step) if replica is not None else 0
                before = reading(name)
                elapsed, tokens = one_round(engines[name], prompts, args.max_tokens)
                rounds[name].append(round_figures(before, reading(name), tokens, elapsed))
                if replica is not None:
                    # Steps after the last admission of the round are decode-only; the
                    # first len(prompts) steps may admit.
                    decode_rpcs[name].extend(
                        list(replica.stats.rpcs_by_step)[mark + args.requests :]
                    )
        classes = {name: type(engine_core(llm).scheduler).__name__ for name, llm in engines.items()}
        lines = [
            f"scheduler classes: stock {classes['stock']}, on kvsvc "
            + ", ".join(sorted({classes[name] for name in on_kvsvc})),
            *render(rounds, LABELS),
        ]
        lines += [
            "",
            f"{'kvsvc calls':<30} {'RPCs/step: all':<16} {'decode-only':<14} resyncs  steps",
        ]
        for name in on_kvsvc:
            counters = replicas[name].stats
            steps, decode = counters.rpcs_by_step, decode_rpcs[name]
            lines.append(
                f"  {LABELS[name]:<28} "
                f"{f'{statistics.median(steps):g} / {max(steps)}':<16} "
                f"{f'{statistics.median(decode):g} / {max(decode)}' if decode else '-':<14} "
                f"{counters.sync_calls:<8} {len(steps):,}"
            )
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()
        engines.clear()
        gc.collect()
    return lines


def sender_cpu_s(replica: Any) -> float:
    """CPU time of the thread that sends the replica's Steps (``send_future``).

    The scheduler hands each Step to it and goes on, so the thread's CPU is kvsvc's cost
    that the scheduler thread's own CPU time does not show. Reached through the client's
    private sender: a benchmark's look inside, not an API.
    """
    sender = replica._client._step_sender
    thread = sender.thread if sender is not None else None
    if thread is None or thread.ident is None or not thread.is_alive():
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


if __name__ == "__main__":
    sys.exit(main())
