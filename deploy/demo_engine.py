"""Traffic for the deployment examples: the simulated engine, round after round, on a pool.

``kvsvc demo`` starts its own server and agents; the compose file and the Kubernetes
example already run those, so their ``engine`` container runs this instead: it waits for
the pool to be READY, then drives it with :class:`kvsvc.demo.engine.SimulatedEngine`
(shared system prompts, multi-turn follow-ups, chunked prefill, decode steps through
``Step``, preemptions when blocks run out), one workload after another with a new seed
each, so the dashboards keep moving. It needs only the client (no torch)::

    python deploy/demo_engine.py --server 127.0.0.1:50051 --pool demo

A step sleeps ``--step-interval`` seconds (a model's decode time) so the engine looks like
one instead of a load test. SIGTERM frees the requests the engine holds, then exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

DEFAULT_SERVER = "127.0.0.1:50051"
DEFAULT_POOL = "demo"


class _Stop(Exception):
    """Leaves the run: at once while waiting, between two steps while the engine runs."""


class _Signals:
    """SIGTERM handling that never interrupts a step half-applied.

    While a workload runs, the handler only sets a flag; the per-step callback raises
    :class:`_Stop` after the step's results are applied, so the engine's view of what the
    server holds stays exact and can be freed.
    """

    def __init__(self) -> None:
        self.engine_running = False
        self.stop_requested = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True
        if not self.engine_running:
            raise _Stop

    def checkpoint(self) -> None:
        if self.stop_requested:
            raise _Stop


_SIGNALS = _Signals()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="demo_engine.py",
        description="Drive a running kvsvc pool with the simulated engine, workload after "
        "workload.",
    )
    parser.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        help="kvsvc gRPC HOST:PORT or unix:PATH, or the framed transport's frames:unix:PATH "
        "/ frames:HOST:PORT",
    )
    parser.add_argument("--pool", default=DEFAULT_POOL, help="pool to drive")
    parser.add_argument(
        "--rounds", type=int, default=0, help="workloads to run (default 0: until stopped)"
    )
    parser.add_argument("--requests", type=int, default=200, help="requests per workload")
    parser.add_argument("--max-running", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per step")
    parser.add_argument(
        "--max-model-len", type=int, default=4096, help="longest request (<= the pool's)"
    )
    parser.add_argument(
        "--step-interval", type=float, default=0.02, help="seconds each step sleeps (0: none)"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for the pool"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the first workload")
    return parser


def _release(kv: Any, engine: Any) -> None:
    """Free what an interrupted engine still holds, so the pool does not leak blocks."""
    held = {r.request_id for r in engine.running} | {rid for rid, _ in engine.to_free}
    if held:
        try:
            kv.free(*sorted(held), timeout=10)
        except Exception as exc:  # the server may be gone already; say so and go
            print(f"could not free {len(held)} requests: {exc}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from kvsvc_client import KVCacheClient

    from kvsvc.demo.engine import SimulatedEngine, WorkloadConfig

    def pace(_engine: Any) -> None:
        _SIGNALS.checkpoint()
        if args.step_interval > 0:
            time.sleep(args.step_interval)
            _SIGNALS.checkpoint()

    with KVCacheClient(args.server, pool=args.pool) as kv:
        print(f"waiting for pool {args.pool!r} on {args.server} ...", flush=True)
        kv.wait_until_ready(timeout=args.ready_timeout)
        print(f"pool {args.pool!r} is READY", flush=True)
        done = 0
        while args.rounds == 0 or done < args.rounds:
            workload = WorkloadConfig(
                num_requests=args.requests,
                max_running=args.max_running,
                token_budget=args.token_budget,
                max_model_len=args.max_model_len,
                seed=args.seed + done,
            )
            engine = SimulatedEngine(kv, workload)
            started = time.monotonic()
            _SIGNALS.engine_running = True
            try:
                # progress_every=0: the callback runs after every step; it paces the
                # engine and is where a SIGTERM takes effect.
                stats = engine.run(progress=pace, progress_every=0.0)
            except _Stop:
                _release(kv, engine)
                print("stopped", flush=True)
                return 0
            finally:
                _SIGNALS.engine_running = False
            done += 1
            print(
                f"workload {done}: {stats.requests_finished} requests, "
                f"hit rate {stats.hit_rate:.1%}, {stats.steps} steps, "
                f"{stats.preemptions} preemptions, {time.monotonic() - started:.1f} s",
                flush=True,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("rounds", "requests", "max_running", "token_budget", "max_model_len"):
        minimum = 0 if name == "rounds" else 1
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}")
    if args.step_interval < 0 or args.ready_timeout <= 0:
        parser.error("--step-interval must be >= 0 and --ready-timeout > 0")
    signal.signal(signal.SIGTERM, _SIGNALS.handler)
    try:
        return run(args)
    except (_Stop, KeyboardInterrupt):
        return 0
    except TimeoutError as exc:
        print(f"demo_engine: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
