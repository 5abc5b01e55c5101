"""``kvsvc vllm-args``: the ``vllm serve`` flags that run vLLM on a kvsvc pool.

The flags are the command-line form of :func:`kvsvc.integrations.vllm.vllm_kwargs`; this
command needs neither vLLM nor a running server. They are printed for an unquoted
``$(kvsvc vllm-args ...)``: every flag is one word the shell hands on unchanged (no
whitespace, no glob character, no quote that would stay in place), see
:func:`kvsvc.integrations.vllm.config.shell_inert_json`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvsvc_client import STEP_SENDERS

from kvsvc.integrations.vllm.config import (
    MAX_STEPS_PER_CALL,
    MAX_TIMEOUT_S,
    KvsvcSettings,
    vllm_kwargs,
    vllm_serve_flags,
)
from kvsvc.server.config import DEFAULT_LISTEN


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "vllm-args",
        help="print the vllm serve flags that run vLLM on a kvsvc pool",
        description="Print the `vllm serve` flags that make vLLM's scheduler allocate through "
        "a kvsvc pool and its workers allocate the pool's plan, as words an unquoted $(...) "
        "passes on unchanged. Tokens never go on a command line: vLLM's scheduler reads "
        "KVSVC_ENGINE_TOKEN (or KVSVC_ENGINE_TOKEN_FILE) and its workers KVSVC_AGENT_TOKEN "
        "(or KVSVC_AGENT_TOKEN_FILE) from the environment, either falling back to "
        "KVSVC_AUTH_TOKEN (or KVSVC_AUTH_TOKEN_FILE).",
        epilog="example: vllm serve MODEL --block-size 32 $(kvsvc vllm-args --server "
        "127.0.0.1:50051 --pool vllm)",
    )
    parser.add_argument("--server", default=DEFAULT_LISTEN, help="kvsvc server HOST:PORT")
    parser.add_argument("--pool", required=True, help="the pool vLLM owns")
    parser.add_argument(
        "--frames",
        metavar="unix:PATH|HOST:PORT",
        help="the scheduler's calls over the server's framed transport at this address "
        "(kvsvc serve --frames-listen); the workers still use --server",
    )
    parser.add_argument(
        "--allow-untested-vllm",
        action="store_true",
        help="let the engine start on a vLLM release outside the range kvsvc supports "
        "(with a warning) instead of refusing it",
    )
    parser.add_argument(
        "--step-sender",
        choices=STEP_SENDERS,
        default="thread",
        help="how the scheduler sends each step's Step while the forward pass runs: by the "
        "client's sender thread (thread, the default) or on the scheduler's own thread "
        "(inline, --frames only: no thread hand-offs, a little less CPU in all, more on the "
        "scheduler's thread)",
    )
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=1,
        metavar="N",
        help=f"at most N scheduling steps' operations in one Step call (1 to "
        f"{MAX_STEPS_PER_CALL}; default 1: every step's own). Steps that admit nothing wait "
        "for a later step's call: fewer calls and wake-ups, the server's view of the pool "
        "(its prefix index, KV events, metrics) up to N-1 steps behind the engine",
    )
    parser.add_argument(
        "--rpc-timeout",
        type=float,
        default=KvsvcSettings.rpc_timeout,
        metavar="SECONDS",
        help=f"deadline of each of the engine's calls (default {KvsvcSettings.rpc_timeout:g}; "
        f"at most {MAX_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--unavailable-timeout",
        type=float,
        default=KvsvcSettings.unavailable_timeout,
        metavar="SECONDS",
        help="how long the scheduler's calls keep being retried while the server cannot be "
        "reached (a restart) before the engine's step fails (default "
        f"{KvsvcSettings.unavailable_timeout:g}; 0: a few quick retries only)",
    )
    parser.add_argument(
        "--plan-timeout",
        type=float,
        default=KvsvcSettings.plan_timeout,
        metavar="SECONDS",
        help="how long each worker waits for the pool's plan at start (default "
        f"{KvsvcSettings.plan_timeout:g})",
    )
    parser.add_argument(
        "--json", action="store_true", help="print vllm_kwargs(...) as JSON instead of flags"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = {
        "frames": args.frames,
        "allow_untested_vllm": args.allow_untested_vllm,
        "step_sender": args.step_sender,
        "steps_per_call": args.steps_per_call,
        "rpc_timeout": args.rpc_timeout,
        "unavailable_timeout": args.unavailable_timeout,
        "plan_timeout": args.plan_timeout,
    }
    try:
        if args.json:
            print(json.dumps(vllm_kwargs(args.server, args.pool, **settings), indent=2))
        else:
            print(" ".join(vllm_serve_flags(args.server, args.pool, **settings)))
    except ValueError as exc:
        raise SystemExit(f"kvsvc vllm-args: {exc}") from None
    return 0
