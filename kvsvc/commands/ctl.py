"""``kvsvc ctl``: the operator's view of a running server (pools, plans, usage, events)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from kvsvc.commands._args import int_at_least, positive_float
from kvsvc.server.config import DEFAULT_LISTEN
from kvsvc.tls import TlsError
from kvsvc.tls_flags import add_client_tls_flags, client_tls_from_args, tls_exit_status


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ctl",
        help="inspect a running server",
        description="Inspect a running kvsvc server: its pools, a pool's plan, usage and events; "
        "score a prompt against the cluster index (score), or ask where it should go (route).",
    )
    parser.add_argument(
        "--server",
        default=DEFAULT_LISTEN,
        help="server address HOST:PORT or unix:PATH, or its framed transport's "
        "frames:unix:PATH / frames:HOST:PORT (not for events, snapshot)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="file with the operator's bearer token (default: env KVSVC_ADMIN_TOKEN, "
        "KVSVC_ADMIN_TOKEN_FILE, then KVSVC_AUTH_TOKEN, KVSVC_AUTH_TOKEN_FILE)",
    )
    parser.add_argument(
        "--auth-token", help="bearer token on the command line (compatibility: visible in ps)"
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline per call, seconds")
    add_client_tls_flags(parser)
    commands = parser.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    pools = commands.add_parser(
        "pools",
        help="list pools with their state and ranks",
        description="Every pool of the server: its state (WAITING_FOR_WORKERS, PLANNED, "
        "READY, DEGRADED), ranks registered, blocks, block size, max model length and hash, "
        "then each rank: device, host, allocation, liveness (plan stream and heartbeat age) "
        "and KV cache size. A pool that is not READY gets a line saying what it waits for.",
    )
    pools.add_argument("--json", action="store_true", help="print the pools as JSON")
    wait = commands.add_parser(
        "wait-ready",
        help="wait until a pool is READY (for scripts)",
        description="Poll the server until POOL is READY (or DEGRADED: serving, with a rank "
        "silent), then print one line and exit 0. Exit 1 after --timeout seconds (the line "
        "says what the pool still waits for), at once for a pool the server does not have "
        "or a refused token; a server that is not up yet is waited for.",
    )
    wait.add_argument("pool")
    wait.add_argument(
        "--timeout",
        dest="wait_timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds to wait (default 60)",
    )
    plan = commands.add_parser(
        "plan",
        help="a pool's memory plan (as `kvsvc plan` prints it)",
        description="The pool's memory plan as `kvsvc plan` prints it (groups, ranks, "
        "blocks, tokens, concurrency), with the pool's state and its last planning error; "
        "'not planned yet' before every rank registered.",
    )
    plan.add_argument("pool")
    plan.add_argument("--json", action="store_true", help="print the plan as `kvsvc plan --json`")
    usage = commands.add_parser(
        "usage",
        help="a pool's block usage and prefix-cache counters",
        description="Blocks used and free, live requests, cached blocks, the prefix-cache "
        "hit rate (tokens served from cache / tokens asked for), evictions and capacity.",
    )
    usage.add_argument("pool")
    usage.add_argument("--json", action="store_true", help="print the counters as JSON")
    events = commands.add_parser(
        "events",
        help="print a pool's KV events as JSON lines",
        description="A pool's prefix-index events (BlockStored, BlockRemoved, "
        "AllBlocksCleared), one JSON line per batch. Without --from only batches made from "
        "now on are shown (a line on stderr says so); --from 1 starts with every batch the "
        "server still holds. Without --count it follows until Ctrl-C; with --count N it "
        "stops after N batches or once it has caught up (the server says when it has sent "
        "every batch it holds; an older server's stream counts as caught up after --idle "
        "seconds without a batch), unless --follow keeps it waiting for the Nth.",
    )
    events.add_argument("pool")
    events.add_argument(
        "--from",
        dest="from_sequence",
        # A sequence number is 64 bits on the wire (WatchEventsRequest.from_sequence).
        type=int_at_least(1, MAX_SEQUENCE),
        metavar="N",
        help="first sequence number (1: the oldest batch held; at most 2^64 - 1)",
    )
    events.add_argument(
        "--count", type=int, metavar="N", help="stop after N batches or when caught up"
    )
    events.add_argument(
        "--follow",
        action="store_true",
        help="with --count: wait for the Nth batch instead of stopping when caught up",
    )
    events.add_argument(
        "--idle",
        type=positive_float,  # 0 would stop before the held batches could arrive
        default=1.0,
        metavar="S",
        help="with --count, from a server that does not say it: seconds (more than 0) "
        "without a batch that count as caught up (default 1)",
    )
    reset = commands.add_parser(
        "reset-prefix-cache",
        help="drop every cached hash of a pool",
        description="Drop every cached block hash of the pool (vLLM's reset_prefix_cache); "
        "refused (exit 1) while requests still hold blocks, unless --force.",
    )
    reset.add_argument("pool")
    reset.add_argument(
        "--force",
        action="store_true",
        help="drop them even while requests hold blocks: the live requests are flagged and "
        "their engines must recompute them (their next allocation answers RECOMPUTE)",
    )
    snapshot = commands.add_parser(
        "snapshot",
        help="write a pool's whole state to a file (for kvsvc serve --restore)",
        description="Write the pool's whole state (plan inputs, hash seed, block pool, prefix "
        "index, live requests, event sequence) to a new file, mode 0600: it holds the "
        "pool's hash seed. `kvsvc serve --restore FILE` starts a server with it.",
    )
    snapshot.add_argument("pool")
    snapshot.add_argument("--out", required=True, metavar="FILE", help="the file to write")
    from kvsvc.cluster.commands import add_route_parser, add_score_parser

    # Both read the cluster index in Redis, not --server.
    add_score_parser(commands)
    add_route_parser(commands)
    parser.set_defaults(func=run)


def connect_flags(args: argparse.Namespace, tls: Any) -> str:
    """The flags that reach the server as this command did (``--server``, TLS as resolved
    from flags and environment, ``--token-file``), for a line to copy: a hint's command
    without them fails against a TLS server. A token given on the command line is left
    out (a secret, and visible in ps): the line says where the token comes from instead."""
    flags = ["--server", args.server]
    if tls is not None:
        for flag, value in (
            ("--tls-ca", tls.ca),
            ("--tls-cert", tls.cert),
            ("--tls-key", tls.key),
            ("--tls-server-name", tls.server_name),
        ):
            if value:
                flags += [flag, value]
    if args.token_file:
        flags += ["--token-file", args.token_file]
    return shlex.join(flags)


def _pools(client: Any, as_json: bool, connect: str) -> int:
    from dataclasses import asdict

    pools = client.list_pools()
    if as_json:
        print(json.dumps([asdict(p) for p in pools], indent=2))
        return 0
    print(
        f"{'POOL':<20} {'STATE':<20} {'RANKS':>7} {'LIVE':>5} {'BLOCKS':>10} {'BLOCK':>6} "
        f"{'MAXLEN':>8}  HASH"
    )
    for p in pools:
        ranks = f"{p.num_registered}/{p.world_size}"
        live = f"{sum(w.live for w in p.workers)}/{p.world_size}"
        planned = p.num_blocks > 0  # block size and length are the plan's: '-' before it
        print(
            f"{p.name:<20} {p.state:<20} {ranks:>7} {live:>5} "
            f"{p.num_blocks if planned else '-':>10} {p.block_size if planned else '-':>6} "
            f"{p.max_model_len if planned else '-':>8}  {p.hash_algo}"
        )
        if p.error:
            print(f"  error: {p.error}")
        for w in p.workers:
            if w.registered:
                print(f"  rank {w.rank}: {_rank_line(w)}")
        hint = _waiting_hint(p, connect)
        if hint:
            print(f"  {hint}")
    return 0


def _rank_line(w: Any) -> str:
    """One registered rank: where, allocated or not, and whether its agent is alive."""
    if w.live:
        liveness = f"live (heartbeat {w.heartbeat_age_seconds:.1f}s ago)"
    elif w.connected:
        liveness = f"NOT LIVE: silent, heartbeat {w.heartbeat_age_seconds:.1f}s ago"
    else:
        liveness = (
            f"NOT LIVE: agent disconnected (plan stream closed), heartbeat "
            f"{w.heartbeat_age_seconds:.1f}s ago"
        )
    return (
        f"{w.device} on {w.hostname or '?'}, "
        f"{'allocated' if w.allocated else 'not allocated'}, {liveness}, "
        f"KV {w.kv_cache_bytes / 2**30:.2f} GiB"
    )


def _waiting_hint(p: Any, connect: str) -> str:
    """What a pool that is not READY waits for, and the command that waits with it
    (``connect``: the flags that reach the server, :func:`connect_flags`)."""
    wait = f"`kvsvc ctl {connect} wait-ready {p.name} --timeout 60` waits for READY"
    if p.state == "WAITING_FOR_WORKERS":
        missing = [w.rank for w in p.workers if not w.registered]
        ranks = ", ".join(map(str, missing)) or "?"
        return f"waiting for agents of rank {ranks} (kvsvc worker --rank N); {wait}"
    if p.state == "PLANNED":
        pending = [w.rank for w in p.workers if not w.allocated]
        ranks = ", ".join(map(str, pending)) or "?"
        return f"planned; waiting for rank {ranks} to report its allocation; {wait}"
    if p.state == "DEGRADED":
        lost = [w for w in p.workers if not w.live]
        gone = ", ".join(str(w.rank) for w in lost) or "?"
        if lost and all(w.in_engine for w in lost):
            return (
                f"serving, but rank {gone} is not live: its agent is the engine's worker "
                "(vLLM on kvsvc): restart the engine (its workers register the ranks again)"
            )
        return (
            f"serving, but rank {gone} is not live: restart its agent (same --rank; it "
            "gets the same plan back)"
        )
    return ""


def _wait_ready(client: Any, pool: str, timeout: float) -> int:
    from kvsvc_client import NotFoundError, NotReadyError

    try:
        # A planning failure is final until the agents register again: say it, stop.
        info = client.wait_until_ready(timeout=timeout, stop_on_plan_error=True)
    except TimeoutError as exc:
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return 1
    except (NotFoundError, NotReadyError) as exc:
        print(f"kvsvc ctl: {exc.details}", file=sys.stderr)
        return 1
    print(
        f"pool {pool!r} is {info.state}: {info.num_registered}/{info.world_size} ranks, "
        f"{info.num_blocks} blocks of {info.block_size} tokens"
    )
    return 0


def _plan(client: Any, pool: str, as_json: bool) -> int:
    response = client.get_plan(pool)
    data = json.loads(response.plan_json)
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"pool {pool}: {data['state']}")
    if data.get("error"):
        print(f"error: {data['error']}")
    if "num_blocks" not in data:
        print("not planned yet")
        return 0
    from kvsvc.commands.plan import render_plan_dict

    print(render_plan_dict(data))
    return 0


def _usage(client: Any, as_json: bool) -> int:
    from dataclasses import asdict

    usage = client.usage()
    if as_json:
        print(json.dumps({**asdict(usage), "hit_rate": usage.hit_rate}, indent=2))
        return 0
    rows = [
        ("blocks", f"{usage.num_blocks - usage.num_free_blocks} used / {usage.num_blocks}"),
        ("usage", f"{usage.usage:.1%}"),
        (
            "requests",
            f"{usage.num_requests}"
            + (
                f" ({usage.num_requests_needing_recompute} need recompute)"
                if usage.num_requests_needing_recompute
                else ""
            ),
        ),
        ("cached blocks", str(usage.num_cached_blocks)),
        (
            "prefix-cache hit rate",
            f"{usage.hit_rate:.1%} ({usage.prefix_cache_hits} of "
            f"{usage.prefix_cache_queries} tokens)",
        ),
        ("evictions", str(usage.num_evictions)),
        ("invalidations", str(usage.num_invalidations)),
        ("capacity", f"{usage.kv_cache_capacity_tokens} tokens"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


# The largest sequence number the wire carries (WatchEventsRequest.from_sequence: uint64).
MAX_SEQUENCE = 2**64 - 1


def _events(
    client: Any,
    from_sequence: int | None,
    count: int | None,
    *,
    follow: bool,
    idle: float,
) -> int:
    """Print batches as JSON lines; see the ``events`` subcommand's description.

    "Caught up" is the server's caught_up marker (asked for, never printed): it has sent
    every batch it holds. A server without markers never says so, so there it is the
    stream staying quiet for ``idle`` seconds (the server sends what it holds back to
    back); a reader thread feeds a queue so the wait for the next batch can time out.
    """
    import queue
    import threading

    from kvsvc_client import KVCacheError

    # "Waiting for new events" is said once the server's first caught_up marker shows the
    # stream is open: not before an unknown pool's NOT_FOUND.
    announced = from_sequence is not None
    batches: queue.Queue[Any] = queue.Queue()

    def read() -> None:
        try:
            for batch in client.watch_events(from_sequence, caught_up=True):
                batches.put(batch)
        except Exception as exc:  # to the main thread, which says it (no thread traceback)
            batches.put(exc)
        batches.put(None)  # the stream ended (the client was closed)

    threading.Thread(target=read, name="kvsvc-ctl-events", daemon=True).start()
    stop_when_idle = count is not None and not follow
    seen = 0
    while count is None or seen < count:
        try:
            item = batches.get(timeout=idle if stop_when_idle else None)
        except queue.Empty:
            print(
                f"kvsvc ctl: caught up after {seen} of {count} batches (none for {idle:g}s; "
                "--follow waits for the rest)",
                file=sys.stderr,
            )
            return 0
        if item is None:
            return 0
        if isinstance(item, KVCacheError):
            raise item
        if isinstance(item, Exception):
            print(f"kvsvc ctl: reading the events failed: {item}", file=sys.stderr)
            return 1
        if item.caught_up:
            if stop_when_idle:
                print(
                    f"kvsvc ctl: caught up after {seen} of {count} batches (the server has "
                    "sent every batch it holds; --follow waits for the rest)",
                    file=sys.stderr,
                )
                return 0
            if not announced:
                announced = True
                print(
                    f"kvsvc ctl: waiting for new events of pool {client.pool!r} (--from 1 "
                    "starts with the held ones; Ctrl-C stops)",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        seen += 1
        print(
            json.dumps(
                {
                    "sequence": item.sequence,
                    "timestamp": item.timestamp,
                    "gap": item.gap,
                    "events": [_event_json(e) for e in item.events],
                }
            ),
            flush=True,
        )
    return 0


def _event_json(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in getattr(event, "__slots__", ()):
        value = getattr(event, name)
        if isinstance(value, bytes):
            value = value.hex()
        elif isinstance(value, tuple):
            value = [v.hex() if isinstance(v, bytes) else v for v in value]
        out[name] = value
    return out


def run(args: argparse.Namespace) -> int:
    from kvsvc_client import (
        ClientOptions,
        KVCacheClient,
        KVCacheError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    if args.ctl_command == "score":
        from kvsvc.cluster.commands import run_score

        return run_score(args)
    if args.ctl_command == "route":
        from kvsvc.cluster.commands import run_route

        return run_route(args)
    pool = getattr(args, "pool", "")
    try:
        tls = client_tls_from_args(args)
        if tls is not None:
            tls.check()
    except TlsError as exc:
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return tls_exit_status(exc)
    options = ClientOptions(
        timeout=args.timeout,
        # An operator's command fails at once when the server is down, not after a wait.
        unavailable_timeout=0.0,
        token=args.auth_token,
        token_file=args.token_file,
        role="admin",
        # Resolved above (flags, then KVSVC_TLS_*): "" keeps the client from looking again.
        tls_ca=(tls.ca or "") if tls else "",
        tls_cert=(tls.cert or "") if tls else "",
        tls_key=(tls.key or "") if tls else "",
        tls_server_name=(tls.server_name or "") if tls else "",
    )
    try:
        with KVCacheClient(args.server, pool=pool, options=options) as client:
            if args.ctl_command == "pools":
                return _pools(client, args.json, connect_flags(args, tls))
            if args.ctl_command == "wait-ready":
                return _wait_ready(client, args.pool, args.wait_timeout)
            if args.ctl_command == "plan":
                return _plan(client, args.pool, args.json)
            if args.ctl_command == "usage":
                return _usage(client, args.json)
            if args.ctl_command == "events":
                return _events(
                    client,
                    args.from_sequence,
                    args.count,
                    follow=args.follow,
                    idle=args.idle,
                )
            if args.ctl_command == "reset-prefix-cache":
                if args.force:
                    flagged, dropped = client.force_reset_prefix_cache()
                    print(
                        f"reset: {dropped} cached blocks dropped, {flagged} live requests "
                        "flagged for recompute"
                    )
                    return 0
                reset = client.reset_prefix_cache()
                print(
                    "reset"
                    if reset
                    else "refused: blocks are still held by requests (--force drops the "
                    "cache anyway and has their engines recompute them)"
                )
                return 0 if reset else 1
            if args.ctl_command == "snapshot":
                try:
                    size = client.snapshot(args.out)
                except OSError as exc:
                    print(f"kvsvc ctl: {exc}", file=sys.stderr)
                    return 1
                print(f"wrote {args.out} ({size} bytes)")
                return 0
    except KVCacheError as exc:
        # A TLS server that drops a connection without a word: the client's error says
        # what was missing (kvsvc_client.errors.connection_hint).
        hint = ""
        if isinstance(exc, UnauthenticatedError | PermissionDeniedError) and (
            "--token-file" not in exc.details  # the server's message may say it already
        ):
            hint = (
                "; kvsvc ctl sends the operator's (admin) token: --token-file FILE, or "
                "KVSVC_ADMIN_TOKEN / KVSVC_ADMIN_TOKEN_FILE (KVSVC_AUTH_TOKEN[_FILE] for a "
                "token of every role)"
            )
        print(f"kvsvc ctl: {exc}{hint}", file=sys.stderr)
        return 1
    except ValueError as exc:  # an unreadable or empty token file
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2
