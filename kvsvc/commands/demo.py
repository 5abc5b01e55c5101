"""``kvsvc demo``: the whole flow on one machine, no GPU needed.

Starts a server and ``--tp`` CPU worker agents as real processes, waits for the pool to be
READY, prints the plan, then runs a simulated engine (shared system prompts, multi-turn
follow-ups, chunked prefill, decode steps through ``Step``, preemptions when blocks run
out) and prints a final table. ``/metrics`` stays up while it runs; Ctrl-C stops
everything cleanly.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

DEFAULT_MODEL = "llama-3.2-1b"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run server + CPU agents + a simulated engine end to end",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=300, help="requests to run (default 300)")
    parser.add_argument(
        "--model-config",
        default=DEFAULT_MODEL,
        help=f"config.json path or bundled model name (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--tp", type=int, default=2, help="tensor-parallel worker agents (default 2)"
    )
    parser.add_argument(
        "--kv-cache-memory",
        default="192MiB",
        help="KV cache budget per agent (default 192MiB: small enough that preemptions happen)",
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-running", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--token-budget", type=int, default=2048, help="tokens per step")
    parser.add_argument("--hash-algo", default="xxh3_128", choices=("xxh3_128", "sha256_cbor"))
    parser.add_argument("--metrics-listen", default="127.0.0.1:0", help="server /metrics address")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="echo the children's logs")
    parser.add_argument(
        "--tls",
        action="store_true",
        help="run everything over mTLS with a throwaway CA made by openssl in a temporary "
        "directory (server: --tls-cert/--tls-key/--tls-client-ca; agents and engine: "
        "--tls-ca/--tls-cert/--tls-key; /metrics over HTTPS)",
    )
    parser.set_defaults(func=run)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _progress(engine: Any, kv: Any, peak: list[int]) -> None:
    """Redraw the live line (and sample the pool's block usage for the peak)."""
    usage = kv.usage()
    used = usage.num_blocks - usage.num_free_blocks
    peak[0] = max(peak[0], used)
    s = engine.stats
    p50 = s.latency_percentile(0.5) * 1e6
    line = (
        f"\r  finished {s.requests_finished:>4}/{engine.workload.num_requests}"
        f"  running {len(engine.running):>3}  waiting {len(engine.waiting):>3}"
        f"  blocks {used:>5}/{usage.num_blocks}  hit rate {s.hit_rate:6.1%}"
        f"  preemptions {s.preemptions:>4}  step p50 {p50:7.0f} us"
    )
    print(line, end="", flush=True)


def _final_table(stats: Any, usage: Any, peak_blocks: int, elapsed: float) -> str:
    rows = [
        ("requests finished", f"{stats.requests_finished}"),
        ("prompt tokens", f"{stats.prompt_tokens}"),
        ("tokens served from cache", f"{stats.cached_tokens}"),
        ("hit rate", f"{stats.hit_rate:.1%} (server: {usage.hit_rate:.1%})"),
        ("tokens generated", f"{stats.generated_tokens}"),
        ("steps", f"{stats.steps}"),
        (
            "Step latency p50 / p99",
            f"{stats.latency_percentile(0.5) * 1e6:.0f} us / "
            f"{stats.latency_percentile(0.99) * 1e6:.0f} us",
        ),
        ("blocks used (peak / total)", f"{peak_blocks} / {usage.num_blocks}"),
        ("NO_SPACE results", f"{stats.no_space}"),
        ("preemptions", f"{stats.preemptions}"),
        ("evictions", f"{usage.num_evictions}"),
        ("wall time", f"{elapsed:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 30)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def _tls_flags(directory: str) -> tuple[list[str], list[str], Any]:
    """Throwaway certificates in ``directory``: the server's flags, the agents' flags and
    the engine's client options (mTLS: everyone shows a certificate of the same CA).

    Raises:
        RuntimeError: openssl is missing or failed (DevCertsError).
    """
    from kvsvc_client import ClientOptions

    from kvsvc.tools.devcerts import make_dev_certs

    certs = make_dev_certs(directory, ("localhost", "127.0.0.1"), days=1)
    server = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    server += ["--tls-client-ca", str(certs.ca)]
    client = ["--tls-ca", str(certs.ca), "--tls-cert", str(certs.client_cert)]
    client += ["--tls-key", str(certs.client_key)]
    options = ClientOptions(
        tls_ca=str(certs.ca), tls_cert=str(certs.client_cert), tls_key=str(certs.client_key)
    )
    return server, client, options


def run(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from kvsvc_client import ClientOptions, KVCacheClient

    from kvsvc.demo.engine import SimulatedEngine, WorkloadConfig
    from kvsvc.demo.processes import spawn, stop_all, wait_for_ports

    if args.requests < 1 or args.tp < 1:
        print("kvsvc demo: --requests and --tp must be >= 1", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM both stop the run cleanly, even when started from a script
    # that left SIGINT ignored (background jobs of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    pool = "demo"
    children = []
    certs_dir = tempfile.TemporaryDirectory(prefix="kvsvc-demo-tls-") if args.tls else None
    server_tls: list[str] = []
    client_tls: list[str] = []
    # Explicit "": the engine's client must not pick up a KVSVC_TLS_* of the caller's shell.
    options = ClientOptions(tls_ca="", tls_cert="", tls_key="")
    try:
        if certs_dir is not None:
            server_tls, client_tls, options = _tls_flags(certs_dir.name)
            print(f"mTLS with a throwaway CA in {certs_dir.name}")
        print(f"starting the server and {args.tp} CPU worker agents ({args.model_config}) ...")
        server = spawn(
            "server",
            [
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                args.metrics_listen,
                "--pool",
                pool,
                "--world-size",
                str(args.tp),
                "--max-model-len",
                str(args.max_model_len),
                "--hash-algo",
                args.hash_algo,
                "--log-level",
                "WARNING",
                *server_tls,
            ],
            echo=args.verbose,
        )
        children.append(server)
        port, metrics_port = wait_for_ports(server)
        address = f"127.0.0.1:{port}"
        for rank in range(args.tp):
            children.append(
                spawn(
                    f"worker{rank}",
                    [
                        "worker",
                        "--server",
                        address,
                        "--pool",
                        pool,
                        "--rank",
                        str(rank),
                        "--world-size",
                        str(args.tp),
                        "--device",
                        "cpu",
                        "--model-config",
                        args.model_config,
                        "--tp",
                        str(args.tp),
                        "--kv-cache-memory",
                        args.kv_cache_memory,
                        *client_tls,
                    ],
                    echo=args.verbose,
                )
            )
        with KVCacheClient(address, pool=pool, options=options) as kv:
            try:
                kv.wait_until_ready(timeout=120)
            except TimeoutError as exc:
                for child in children:
                    if child.output():
                        print(f"--- {child.name} ---\n{child.output()}", file=sys.stderr)
                print(f"kvsvc demo: {exc}", file=sys.stderr)
                return 1
            print(
                f"pool {pool!r} is READY on {address}"
                + (
                    f"; metrics at {'https' if args.tls else 'http'}://127.0.0.1:"
                    f"{metrics_port}/metrics"
                    if metrics_port
                    else ""
                )
            )
            plan = json.loads(kv.get_plan().plan_json)
            from kvsvc.commands.plan import render_plan_dict

            print(render_plan_dict(plan, {"model": args.model_config, "tp": args.tp, "pp": 1}))
            workload = WorkloadConfig(
                num_requests=args.requests,
                max_running=args.max_running,
                token_budget=args.token_budget,
                max_model_len=args.max_model_len,
                seed=args.seed,
            )
            engine = SimulatedEngine(kv, workload)
            peak = [0]
            print(f"running {args.requests} requests through the simulated engine:")
            started = time.monotonic()
            stats = engine.run(progress=lambda e: _progress(e, kv, peak), progress_every=0.1)
            elapsed = time.monotonic() - started
            _progress(engine, kv, peak)
            print()
            print(_final_table(stats, kv.usage(), peak[0], elapsed))
        for child in children[1:]:
            if not child.alive():
                print(f"kvsvc demo: {child.name} exited early:\n{child.output()}", file=sys.stderr)
                return 1
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the agents and the server ...", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvsvc demo: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)
        if certs_dir is not None:
            certs_dir.cleanup()
