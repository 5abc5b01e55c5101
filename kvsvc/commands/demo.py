"""``kvsvc demo``: the whole flow on one machine, no GPU needed.

Starts a server and ``--tp`` CPU worker agents as real processes, waits for the pool to be
READY, prints the plan, then runs a simulated engine (shared system prompts, multi-turn
follow-ups, chunked prefill, decode steps through ``Step``, preemptions when blocks run
out) and prints a final table. ``/metrics`` is up while it runs (``--keep-serving`` keeps
the server, the agents and ``/metrics`` up after the table, until Ctrl-C); Ctrl-C stops
everything cleanly.

Exit status: 0 done; 1 a process failed or a port is taken; 2 bad flags; 130 interrupted
(0 when ``--keep-serving`` was waiting for the Ctrl-C).
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
    parser.add_argument(
        "--metrics-listen",
        default="127.0.0.1:0",
        help="server /metrics address (default 127.0.0.1:0: any free port, printed)",
    )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="after the final table keep the server, agents and /metrics up until Ctrl-C "
        "(a 300-request run lasts a few seconds: too short to scrape or inspect)",
    )
    parser.add_argument(
        "--frames",
        action="store_true",
        help="the simulated engine calls over the server's framed transport on a Unix socket "
        "(kvsvc serve --frames-listen; the sidecar case) instead of gRPC; the agents stay "
        "on gRPC",
    )
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


class Progress:
    """The live progress line: redrawn in place on a terminal, plain lines otherwise.

    Redrawing with ``\\r`` every 0.1 s suits a terminal; in a log file (``make demo > log``)
    the same bytes become one endless line. Off a terminal it prints a line at most every
    ``log_every`` seconds, and the last state once at the end.
    """

    def __init__(self, kv: Any, *, tty: bool, log_every: float = 2.0) -> None:
        self._kv = kv
        self._tty = tty
        self._log_every = log_every
        self._last_logged: float | None = None
        self.peak_blocks = 0

    def update(self, engine: Any, *, final: bool = False) -> None:
        """Sample the pool's block usage (for the peak) and show the line if it is due."""
        usage = self._kv.usage()
        used = usage.num_blocks - usage.num_free_blocks
        self.peak_blocks = max(self.peak_blocks, used)
        now = time.monotonic()
        last = self._last_logged
        if not self._tty and not final and last is not None and now - last < self._log_every:
            return
        self._last_logged = now
        s = engine.stats
        p50 = s.latency_percentile(0.5) * 1e6
        line = (
            f"  finished {s.requests_finished:>4}/{engine.workload.num_requests}"
            f"  running {len(engine.running):>3}  waiting {len(engine.waiting):>3}"
            f"  blocks {used:>5}/{usage.num_blocks}  hit rate {s.hit_rate:6.1%}"
            f"  preemptions {s.preemptions:>4}  step p50 {p50:7.0f} us"
        )
        if self._tty:
            print("\r" + line, end="\n" if final else "", flush=True)
        else:
            print(line, flush=True)


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


def _check_metrics_listen(listen: str) -> None:
    """Fail before anything starts when the server's ``/metrics`` address is taken.

    Raises:
        ConfigError: not ``HOST:PORT``.
        ListenError: the address cannot be bound (one line naming ``--metrics-listen``).
    """
    from kvsvc.ports import check_bindable
    from kvsvc.server.config import split_host_port

    if listen == "off":
        return
    host, port = split_host_port(listen, "--metrics-listen")
    check_bindable(host, port, address=listen, what="server /metrics", flag="--metrics-listen")


def _serve_until_interrupted(address: str, metrics_url: str) -> None:
    """``--keep-serving``: hold everything up until Ctrl-C (or SIGTERM)."""
    print(
        f"--keep-serving: the server ({address}), its agents and {metrics_url or '/metrics'} "
        "stay up; try `kvsvc ctl --server " + address + " pools`. Ctrl-C stops everything.",
        flush=True,
    )
    while True:
        time.sleep(3600)


def run(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from kvsvc_client import ClientOptions, KVCacheClient

    from kvsvc.demo.engine import SimulatedEngine, WorkloadConfig
    from kvsvc.demo.processes import spawn, stop_all, wait_for_ports
    from kvsvc.ports import ListenError
    from kvsvc.server.config import ConfigError

    if args.requests < 1 or args.tp < 1:
        print("kvsvc demo: --requests and --tp must be >= 1", file=sys.stderr)
        return 2
    try:
        _check_metrics_listen(args.metrics_listen)
    except ConfigError as exc:
        print(f"kvsvc demo: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"kvsvc demo: {exc}", file=sys.stderr)
        return 1
    # Ctrl-C and SIGTERM both stop the run cleanly, even when started from a script
    # that left SIGINT ignored (background jobs of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    pool = "demo"
    children = []
    certs_dir = tempfile.TemporaryDirectory(prefix="kvsvc-demo-tls-") if args.tls else None
    # Short and private: a socket path must fit in 108 bytes.
    frames_dir = tempfile.TemporaryDirectory(prefix="kvsvc-demo-") if args.frames else None
    frames_flags = ["--frames-listen", f"unix:{frames_dir.name}/frames.sock"] if frames_dir else []
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
                *frames_flags,
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
        engine_target = f"frames:{frames_flags[1]}" if frames_flags else address
        with KVCacheClient(engine_target, pool=pool, options=options) as kv:
            try:
                kv.wait_until_ready(timeout=120)
            except TimeoutError as exc:
                for child in children:
                    if child.output():
                        print(f"--- {child.name} ---\n{child.output()}", file=sys.stderr)
                print(f"kvsvc demo: {exc}", file=sys.stderr)
                return 1
            metrics_url = (
                f"{'https' if args.tls else 'http'}://127.0.0.1:{metrics_port}/metrics"
                if metrics_port
                else ""
            )
            print(
                f"pool {pool!r} is READY on {address}"
                + (f"; the engine calls over {engine_target}" if frames_flags else "")
                + (
                    f"; metrics at {metrics_url}"
                    + ("" if args.keep_serving else " while the run lasts (--keep-serving: after)")
                    if metrics_url
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
            progress = Progress(kv, tty=sys.stdout.isatty())
            print(f"running {args.requests} requests through the simulated engine:", flush=True)
            started = time.monotonic()
            stats = engine.run(progress=progress.update, progress_every=0.1)
            elapsed = time.monotonic() - started
            progress.update(engine, final=True)
            print(_final_table(stats, kv.usage(), progress.peak_blocks, elapsed), flush=True)
        for child in children[1:]:
            if not child.alive():
                print(f"kvsvc demo: {child.name} exited early:\n{child.output()}", file=sys.stderr)
                return 1
        if args.keep_serving:
            try:
                _serve_until_interrupted(address, metrics_url)
            except KeyboardInterrupt:
                print("\nstopping the agents and the server ...", file=sys.stderr)
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
        if frames_dir is not None:
            frames_dir.cleanup()
