"""``kvsvc ctl``: the operator's view of a running server (pools, plans, usage, events)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvsvc.commands._tls import add_client_tls_flags, client_tls_from_args, tls_exit_status
from kvsvc.server.config import DEFAULT_LISTEN
from kvsvc.tls import TlsError


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "ctl",
        help="inspect a running server",
        description="Inspect a running kvsvc server: its pools, a pool's plan, usage and events.",
    )
    parser.add_argument("--server", default=DEFAULT_LISTEN, help="server address HOST:PORT")
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
    pools = commands.add_parser("pools", help="list pools with their state and ranks")
    pools.add_argument("--json", action="store_true")
    plan = commands.add_parser("plan", help="a pool's memory plan (as `kvsvc plan` prints it)")
    plan.add_argument("pool")
    plan.add_argument("--json", action="store_true")
    usage = commands.add_parser("usage", help="a pool's block usage and prefix-cache counters")
    usage.add_argument("pool")
    usage.add_argument("--json", action="store_true")
    events = commands.add_parser("events", help="follow a pool's KV events as JSON lines")
    events.add_argument("pool")
    events.add_argument("--from", dest="from_sequence", type=int, help="first sequence number")
    events.add_argument("--count", type=int, help="stop after this many batches")
    reset = commands.add_parser("reset-prefix-cache", help="drop every cached hash of a pool")
    reset.add_argument("pool")
    parser.set_defaults(func=run)


def _pools(client: Any, as_json: bool) -> int:
    from dataclasses import asdict

    pools = client.list_pools()
    if as_json:
        print(json.dumps([asdict(p) for p in pools], indent=2))
        return 0
    print(
        f"{'POOL':<20} {'STATE':<20} {'RANKS':>7} {'BLOCKS':>10} {'BLOCK':>6} {'MAXLEN':>8}  HASH"
    )
    for p in pools:
        ranks = f"{p.num_registered}/{p.world_size}"
        print(
            f"{p.name:<20} {p.state:<20} {ranks:>7} {p.num_blocks:>10} {p.block_size:>6} "
            f"{p.max_model_len:>8}  {p.hash_algo}"
        )
        if p.error:
            print(f"  error: {p.error}")
        for w in p.workers:
            if w.registered:
                print(
                    f"  rank {w.rank}: {w.device} on {w.hostname or '?'}, "
                    f"{'allocated' if w.allocated else 'not allocated'}, "
                    f"heartbeat {w.heartbeat_age_seconds:.1f}s ago, "
                    f"KV {w.kv_cache_bytes / 2**30:.2f} GiB"
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
        ("requests", str(usage.num_requests)),
        ("cached blocks", str(usage.num_cached_blocks)),
        (
            "prefix-cache hit rate",
            f"{usage.hit_rate:.1%} ({usage.prefix_cache_hits} of "
            f"{usage.prefix_cache_queries} tokens)",
        ),
        ("evictions", str(usage.num_evictions)),
        ("capacity", f"{usage.kv_cache_capacity_tokens} tokens"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _events(client: Any, from_sequence: int | None, count: int | None) -> int:
    for seen, batch in enumerate(client.watch_events(from_sequence), start=1):
        print(
            json.dumps(
                {
                    "sequence": batch.sequence,
                    "timestamp": batch.timestamp,
                    "gap": batch.gap,
                    "events": [_event_json(e) for e in batch.events],
                }
            ),
            flush=True,
        )
        if count is not None and seen >= count:
            return 0
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
    from kvsvc_client import ClientOptions, KVCacheClient, KVCacheError, UnavailableError

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
                return _pools(client, args.json)
            if args.ctl_command == "plan":
                return _plan(client, args.pool, args.json)
            if args.ctl_command == "usage":
                return _usage(client, args.json)
            if args.ctl_command == "events":
                return _events(client, args.from_sequence, args.count)
            if args.ctl_command == "reset-prefix-cache":
                reset = client.reset_prefix_cache()
                print("reset" if reset else "refused: blocks are still held by requests")
                return 0 if reset else 1
    except KVCacheError as exc:
        # A TLS server drops a plaintext client's connection without a word: say so.
        hint = (
            "; if the server uses TLS, give --tls-ca (or KVSVC_TLS_CA)"
            if isinstance(exc, UnavailableError) and tls is None
            else ""
        )
        print(f"kvsvc ctl: {exc}{hint}", file=sys.stderr)
        return 1
    except ValueError as exc:  # an unreadable or empty token file
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2
