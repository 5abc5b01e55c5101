"""``kvsvc replay TRACE``: a request trace through real servers, the index and the router.

For each fleet size (``--engines``, ``--kv-tokens``) and routing policy it starts one
``kvsvc serve`` per engine, ``kvsvc indexer`` and ``kvsvc router`` (on ``--redis``, or a
private ``redis-server``), replays the trace with simulated engines that admit with
Allocate, decode with Step and free at the end under a stated service model, and reports
the prefix hit ratio, the load balance, preemptions, queueing and TTFT, beside the
bounds kvsvc's core computes for the same memory (an infinite cache; one cache of the
whole memory). A capacity-planning tool as much as a benchmark: docs/cluster.md,
"Routing".

Ctrl-C or SIGTERM stops the fleet it started (servers, indexer, router, its redis-server)
before it exits. Exit status: 0 done; 1 a process failed; 2 bad flags or a bad trace; 130
interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvsvc.replay.trace import DEFAULT_TRACE_BLOCK_SIZE

DEFAULT_ENGINES = "8"
DEFAULT_KV_TOKENS = "2M"
# Trace seconds per wall second. The shared 17-minute trace at 8 engines replays each
# policy in about 1.7 minutes at 10 on two cores, all four and the bounds in under 10.
DEFAULT_TIME_SCALE = 10.0
DEFAULT_LOAD_INTERVAL_S = 0.1
DEFAULT_LOAD_TTL_S = 2.0
MAX_ENGINES = 64


def _counts(text: str, flag: str, least: int, most: int) -> list[int]:
    """``4,8,16`` or ``1M,2M`` (k = 10^3, M = 10^6) as sorted distinct integers."""
    out = set()
    for part in text.split(","):
        word = part.strip()
        if not word:
            raise ValueError(f"{flag} {text!r}: an empty item")
        scale = 1
        if word[-1:] in ("k", "K"):
            word, scale = word[:-1], 1000
        elif word[-1:] in ("m", "M"):
            word, scale = word[:-1], 1_000_000
        try:
            value = float(word) * scale
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {part.strip()!r} is not a number") from None
        if value != int(value) or not least <= value <= most:
            raise ValueError(
                f"{flag} {text!r}: {part.strip()} is not an integer in [{least}, {most}]"
            )
        out.add(int(value))
    return sorted(out)


def add_parser(subparsers: Any) -> None:
    from kvsvc.cluster.commands import add_policy_flags
    from kvsvc.replay.engine import ServiceModel
    from kvsvc.replay.run import POLICIES

    model = ServiceModel()
    parser = subparsers.add_parser(
        "replay",
        help="replay a request trace through real servers, the cluster index and its router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "trace",
        metavar="TRACE",
        help="JSONL: timestamp (ms), input_length, output_length, hash_ids (Mooncake's format)",
    )
    parser.add_argument(
        "--trace-block-size",
        type=int,
        default=DEFAULT_TRACE_BLOCK_SIZE,
        metavar="N",
        help=f"tokens per hash_ids entry, and the pools' block size (default "
        f"{DEFAULT_TRACE_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--engines",
        default=DEFAULT_ENGINES,
        metavar="N[,N...]",
        help=f"fleet sizes to replay (default {DEFAULT_ENGINES}; e.g. 4,8,16)",
    )
    parser.add_argument(
        "--kv-tokens",
        default=DEFAULT_KV_TOKENS,
        metavar="T[,T...]",
        help=f"KV cache tokens per engine (default {DEFAULT_KV_TOKENS}; k and M suffixes; a "
        "list sweeps capacity)",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        metavar="P[,P...]",
        help=f"routing policies (default all: {', '.join(POLICIES)})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=0,
        metavar="N",
        help="replay the first N requests only (default: all)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        metavar="X",
        help=f"trace seconds per wall second (default {DEFAULT_TIME_SCALE:g}); the index's "
        "and the loads' lags are real seconds, so a larger scale makes them larger in "
        "trace time",
    )
    service = parser.add_argument_group(
        "service model", "What an engine's time goes to (docs/cluster.md, Routing)."
    )
    service.add_argument(
        "--prefill-tps",
        type=float,
        default=model.prefill_tps,
        metavar="N",
        help=f"prompt tokens prefilled per second, the uncached part (default "
        f"{model.prefill_tps:g})",
    )
    service.add_argument(
        "--decode-ms",
        type=float,
        default=model.decode_s * 1000,
        metavar="MS",
        help=f"one decode iteration (default {model.decode_s * 1000:g})",
    )
    service.add_argument(
        "--max-batched-tokens",
        type=int,
        default=model.max_batched_tokens,
        metavar="N",
        help=f"tokens per step at most (default {model.max_batched_tokens})",
    )
    service.add_argument(
        "--max-num-seqs",
        type=int,
        default=model.max_num_seqs,
        metavar="N",
        help=f"running requests per engine at most (default {model.max_num_seqs})",
    )
    service.add_argument(
        "--step-iterations",
        type=int,
        default=model.step_iterations,
        metavar="N",
        help=f"decode iterations one Step call may cover (default {model.step_iterations})",
    )
    add_policy_flags(parser)
    index = parser.add_argument_group("the index")
    index.add_argument(
        "--redis",
        metavar="URL",
        help="a running Redis for the index (its keys go under a prefix of their own and "
        "are deleted at the end); default: a private redis-server the replay starts",
    )
    index.add_argument(
        "--load-interval",
        type=float,
        default=DEFAULT_LOAD_INTERVAL_S,
        metavar="S",
        help=f"the indexer's --load-interval (default {DEFAULT_LOAD_INTERVAL_S:g})",
    )
    index.add_argument(
        "--load-ttl",
        type=float,
        default=DEFAULT_LOAD_TTL_S,
        metavar="S",
        help=f"the indexer's --load-ttl (default {DEFAULT_LOAD_TTL_S:g})",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw hit ratio and load per policy and fleet size (needs kvsvc[replay])",
    )
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=run)


def _settings(args: argparse.Namespace) -> tuple[list[int], list[int], list[str], Any, Any]:
    """The checked flags: fleet sizes, KV tokens, policies, the service model, Route's
    weights.

    Raises:
        ValueError: a bad flag (named).
    """
    from kvsvc.cluster.commands import policy_from_args
    from kvsvc.replay.engine import ServiceModel
    from kvsvc.replay.run import POLICIES

    engines = _counts(args.engines, "--engines", 1, MAX_ENGINES)
    kv_tokens = _counts(args.kv_tokens, "--kv-tokens", 1, 1 << 40)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(
            f"--policies {args.policies!r}: unknown {', '.join(unknown) or 'none given'} "
            f"(valid: {', '.join(POLICIES)})"
        )
    if not args.time_scale > 0 or args.time_scale == float("inf"):
        raise ValueError(f"--time-scale must be > 0, got {args.time_scale:g}")
    if args.requests < 0:
        raise ValueError(f"--requests must be >= 0, got {args.requests}")
    if not args.trace_block_size >= 1:
        raise ValueError(f"--trace-block-size must be >= 1, got {args.trace_block_size}")
    if not args.load_interval > 0:
        raise ValueError(f"--load-interval must be > 0, got {args.load_interval:g}")
    if not args.load_ttl >= 2 * args.load_interval:
        raise ValueError("--load-ttl must be at least twice --load-interval")
    model = ServiceModel(
        args.prefill_tps,
        args.decode_ms / 1000,
        args.max_batched_tokens,
        args.max_num_seqs,
        args.step_iterations,
    ).check()
    for kv in kv_tokens:
        if kv < args.trace_block_size:
            raise ValueError(f"--kv-tokens {kv} is less than one block ({args.trace_block_size})")
    return engines, kv_tokens, list(dict.fromkeys(policies)), model, policy_from_args(args)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvsvc.replay.bounds import cache_bound
    from kvsvc.replay.fleet import Fleet, FleetError, PrivateRedis, delete_keys
    from kvsvc.replay.report import FleetRun, plot, table, to_json
    from kvsvc.replay.run import fits, replay
    from kvsvc.replay.trace import TraceError, read_trace

    try:
        engines, kv_tokens, policies, model, weights = _settings(args)
        trace = read_trace(args.trace, args.trace_block_size)
        if args.requests:
            trace = trace[: args.requests]
        too_big = fits(trace, min(kv_tokens), args.trace_block_size)
        if too_big is not None:
            raise ValueError(
                f"request {too_big.index + 1} of the trace ({too_big.input_length} + "
                f"{too_big.output_length} tokens) does not fit in --kv-tokens {min(kv_tokens)}"
            )
        if args.plot:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError("--plot needs matplotlib: pip install 'kvsvc[replay]'")
    except (ValueError, TraceError) as exc:
        print(f"kvsvc replay: {exc}", file=sys.stderr)
        return 2

    def say(text: str) -> None:
        if not args.quiet:
            print(f"kvsvc replay: {text}", file=sys.stderr, flush=True)

    block = args.trace_block_size
    longest = max(r.input_length + r.output_length for r in trace)
    max_model_len = -(-longest // block) * block
    span = trace[-1].arrival_s - trace[0].arrival_s
    header = {
        "trace": {
            "path": os.path.basename(args.trace),
            "requests": len(trace),
            "span_s": span,
            "mean_prompt_tokens": sum(r.input_length for r in trace) / len(trace),
            "mean_output_tokens": sum(r.output_length for r in trace) / len(trace),
            "block_size": block,
        },
        "service_model": asdict(model),
        "route_policy": asdict(weights),
        "time_scale": args.time_scale,
        "load_interval_s": args.load_interval,
        "load_ttl_s": args.load_ttl,
    }

    def terminate(*_: object) -> None:
        raise KeyboardInterrupt  # the fleet's processes are stopped on the way out

    signal.signal(signal.SIGTERM, terminate)
    say(f"{len(trace)} requests over {span / 60:.1f} min; bounds first (kvsvc's core)")
    redis = None
    runs: list[FleetRun] = []
    started = time.monotonic()
    try:
        infinite = cache_bound(trace, block, None)
        redis_url = args.redis
        if redis_url is None:
            redis = PrivateRedis()
            redis_url = redis.url
        workdir = Path(tempfile.mkdtemp(prefix="kvsvc-replay-"))
        run_id = uuid.uuid4().hex[:8]
        for kv in kv_tokens:
            for count in engines:
                num_blocks = kv // block
                shared = cache_bound(trace, block, count * num_blocks)
                fleet_run = FleetRun(count, kv, infinite, shared)
                runs.append(fleet_run)
                for name in policies:
                    prefix = f"kvsvc-replay-{run_id}-{count}-{kv}-{name}"
                    fleet = Fleet(
                        count, block, num_blocks, max_model_len, redis_url, prefix, weights,
                        args.load_interval, args.load_ttl, workdir,
                    )  # fmt: skip
                    say(f"{name} on {count} engines x {kv:,} tokens: starting the fleet")
                    fleet.start()
                    try:
                        result = replay(trace, fleet, name, model, args.time_scale, say)
                    finally:
                        fleet.stop()
                        if args.redis:
                            delete_keys(redis_url, prefix)
                    fleet_run.policies.append(result)
                    say(
                        f"{name} on {count} engines: hit ratio {result.hit_ratio:.3f}, load "
                        f"max/mean {result.load_max_mean:.2f} ({result.wall_s:.0f} s)"
                    )
    except FleetError as exc:
        print(f"kvsvc replay: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvsvc replay: interrupted", file=sys.stderr)
        return 130
    finally:
        if redis is not None:
            redis.stop()
    header["wall_s"] = time.monotonic() - started
    if args.plot:
        name = os.path.basename(args.trace)
        plot(runs, args.plot, f"kvsvc replay {name}: {len(trace):,} requests")
    if args.json:
        print(json.dumps(to_json(header, runs), indent=2))
        return 0
    print(
        f"{os.path.basename(args.trace)}: {len(trace):,} requests over {span / 60:.1f} min, "
        f"mean prompt {header['trace']['mean_prompt_tokens']:,.0f} tokens, blocks of {block}; "
        f"time scale {args.time_scale:g}"
    )
    print(
        f"service model: prefill {model.prefill_tps:,.0f} tokens/s, decode "
        f"{model.decode_s * 1000:g} ms/iteration, {model.max_batched_tokens} tokens/step, "
        f"{model.max_num_seqs} requests\n"
        f"Route: prefix weight {weights.prefix_weight:g}, load weight {weights.load_weight:g}, "
        f"load floor {weights.load_floor:g}\n"
    )
    print(table(runs))
    return 0
