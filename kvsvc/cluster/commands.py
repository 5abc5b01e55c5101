"""``kvsvc indexer``, ``kvsvc router``, ``kvsvc ctl score`` and ``kvsvc ctl route``: the
cluster index's commands.

Nothing here imports redis at module level: ``kvsvc --help`` works without the
``cluster`` extra, and a command that needs it says how to install it.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvsvc.cluster.layout import DEFAULT_PREFIX, Keys

DEFAULT_INDEXER_METRICS = "127.0.0.1:9410"
DEFAULT_ROUTER_LISTEN = "127.0.0.1:50061"
HASH_SEED_ENV = "KVSVC_HASH_SEED_FILE"
_NO_REDIS = "the cluster index needs the redis package: pip install 'kvsvc[cluster]'"


def _redis_flags(parser: Any) -> None:
    parser.add_argument(
        "--redis",
        required=True,
        metavar="URL",
        help="the index's Redis: redis://HOST:PORT (a Redis Cluster node works too: the "
        "others are found from it), rediss:// for TLS",
    )
    parser.add_argument(
        "--key-prefix",
        default=DEFAULT_PREFIX,
        help=f"prefix of every key (default {DEFAULT_PREFIX}): several indexes in one Redis",
    )


def _seed_flags(parser: Any) -> None:
    parser.add_argument(
        "--hash-seed-file",
        metavar="FILE",
        help="the cluster's hash seed, as the servers' --hash-seed-file (default: env "
        f"{HASH_SEED_ENV}); needed for xxh3_128 servers",
    )


def _read_seed(args: argparse.Namespace) -> str | None:
    import os

    from kvsvc.core.seed import read_seed_file

    path = args.hash_seed_file or os.environ.get(HASH_SEED_ENV)
    return read_seed_file(path) if path else None


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


# -- kvsvc indexer -----------------------------------------------------------------------


def add_indexer_parser(subparsers: Any) -> None:
    from kvsvc.cluster.source import (
        DEFAULT_LEASE_TTL_S,
        DEFAULT_LOAD_INTERVAL_S,
        DEFAULT_LOAD_TTL_S,
        DEFAULT_MAX_BATCH_EVENTS,
        DEFAULT_PURGE_AFTER_S,
    )
    from kvsvc.tls_flags import add_client_tls_flags, add_metrics_tls_flags

    parser = subparsers.add_parser(
        "indexer",
        help="follow kvsvc servers' events into the cluster index on Redis",
        description="Follow each source's WatchEvents (HOST:PORT/POOL of a kvsvc server) "
        "and keep, in Redis, which engines cache which blocks. Resumes from the sequence "
        "stored in Redis after a restart, heals gaps and new epochs from the source's "
        "SnapshotIndex, purges a source that is cleared, restarted empty, removed or gone "
        "past --purge-after. Several indexers may run at once: a lease per source says "
        "which one writes it.",
    )
    _redis_flags(parser)
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="HOST:PORT/POOL",
        help="a kvsvc server's pool to index (again for more)",
    )
    parser.add_argument(
        "--sources-file",
        metavar="FILE",
        help="more sources, one per line (# comments); re-read every second: a source "
        "added starts, one removed is purged",
    )
    parser.add_argument(
        "--zmq-source",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT[,replay=tcp://HOST:PORT]",
        help="a vLLM-format ZMQ KV event stream (vLLM's --kv-events-config publisher, or "
        "kvsvc serve --kv-events-zmq), named by its endpoint; replay= its ROUTER endpoint, "
        "asked when messages were missed (again for more; needs kvsvc[vllm])",
    )
    parser.add_argument(
        "--zmq-hash-algo",
        choices=("sha256_cbor", "xxh3_128"),
        default="sha256_cbor",
        help="how the ZMQ sources hash blocks (default sha256_cbor: vLLM's "
        "--prefix-caching-hash-algo sha256_cbor, the only one a router can repeat)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="the sources' indexer token (the servers' --indexer-token-file role: their "
        "event streams and index snapshots, nothing else; default: env "
        "KVSVC_INDEXER_TOKEN[_FILE], KVSVC_AUTH_TOKEN[_FILE])",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_LEASE_TTL_S,
        metavar="S",
        help=f"a source's lease lasts this long unrenewed (default {DEFAULT_LEASE_TTL_S:g}): "
        "another indexer takes over this long after its writer stopped",
    )
    parser.add_argument(
        "--purge-after",
        type=float,
        default=DEFAULT_PURGE_AFTER_S,
        metavar="S",
        help=f"purge a source unreachable this long (default {DEFAULT_PURGE_AFTER_S:g})",
    )
    parser.add_argument(
        "--max-batch-events",
        type=int,
        default=DEFAULT_MAX_BATCH_EVENTS,
        metavar="N",
        help=f"block events per Redis script call at most (default {DEFAULT_MAX_BATCH_EVENTS})",
    )
    parser.add_argument(
        "--load-interval",
        type=float,
        default=DEFAULT_LOAD_INTERVAL_S,
        metavar="S",
        help="ask each source's load (GetUsage: running requests, blocks held) this often "
        f"and write it for Route (default {DEFAULT_LOAD_INTERVAL_S:g}; 0: never)",
    )
    parser.add_argument(
        "--load-ttl",
        type=float,
        default=DEFAULT_LOAD_TTL_S,
        metavar="S",
        help="a load report counts this long (default "
        f"{DEFAULT_LOAD_TTL_S:g}); past it Route counts the engine at the mean load",
    )
    parser.add_argument(
        "--metrics-listen",
        default=DEFAULT_INDEXER_METRICS,
        metavar="HOST:PORT",
        help=f"/metrics (default {DEFAULT_INDEXER_METRICS}; port 0: any free one; off: none)",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    add_client_tls_flags(parser)
    add_metrics_tls_flags(parser.add_argument_group("/metrics over HTTPS"))
    parser.set_defaults(func=run_indexer)


def run_indexer(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import redis
    except ImportError:
        print(f"kvsvc indexer: {_NO_REDIS}", file=sys.stderr)
        return 2
    from kvsvc_client import ClientOptions

    from kvsvc.cluster.indexer import Indexer, read_sources_file
    from kvsvc.cluster.indexer import watch_sources_file as watch
    from kvsvc.cluster.metrics import IndexerMetrics
    from kvsvc.cluster.source import IndexerOptions
    from kvsvc.cluster.store import connect, parse_source
    from kvsvc.tls_flags import client_tls_from_args, metrics_tls_from_args

    try:
        for source in args.source:
            parse_source(source)
        sources = list(args.source)
        if args.sources_file:
            sources += read_sources_file(args.sources_file)
        if not sources and not args.sources_file and not args.zmq_source:
            raise ValueError(
                "give at least one --source HOST:PORT/POOL, --sources-file or --zmq-source"
            )
        from kvsvc.cluster.zmq_source import parse_zmq_source

        for zmq_source in args.zmq_source:
            parse_zmq_source(zmq_source)
        for flag, value in (("--lease-ttl", args.lease_ttl), ("--purge-after", args.purge_after)):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0, got {value:g}")
        if args.max_batch_events < 1:
            raise ValueError(f"--max-batch-events must be >= 1, got {args.max_batch_events}")
        if not args.load_interval >= 0:
            raise ValueError(f"--load-interval must be >= 0, got {args.load_interval:g}")
        if args.load_interval and not args.load_ttl >= 2 * args.load_interval:
            raise ValueError(
                f"--load-ttl {args.load_ttl:g} must be at least twice --load-interval "
                f"{args.load_interval:g} (a report must outlive the wait for the next one)"
            )
        metrics_address = (
            None
            if args.metrics_listen == "off"
            else _host_port(args.metrics_listen, "--metrics-listen")
        )
        tls = client_tls_from_args(args)
        metrics_tls = metrics_tls_from_args(args)
    except ValueError as exc:  # TlsError is one
        print(f"kvsvc indexer: {exc}", file=sys.stderr)
        return 2
    client_options = ClientOptions(
        role="indexer",
        token_file=args.token_file,
        unavailable_timeout=0.0,
        tls_ca=(tls.ca or "") if tls else "",
        tls_cert=(tls.cert or "") if tls else "",
        tls_key=(tls.key or "") if tls else "",
        tls_server_name=(tls.server_name or "") if tls else "",
    )
    from kvsvc.ports import Listener, ListenError, check_listeners

    metrics_listener = (
        Listener(args.metrics_listen, "indexer /metrics", "--metrics-listen", *metrics_address)
        if metrics_address is not None
        else None
    )
    try:  # before anything starts, as every kvsvc command that listens
        check_listeners([metrics_listener] if metrics_listener is not None else [])
    except ListenError as exc:
        print(exc.report("kvsvc indexer"), file=sys.stderr)
        return 1
    try:
        client = connect(args.redis)
        client.ping()
    except (ValueError, redis.exceptions.RedisError) as exc:
        print(f"kvsvc indexer: --redis {args.redis}: {exc}", file=sys.stderr)
        return 1
    metrics = IndexerMetrics()
    metrics_port = 0
    metrics_server = None
    if metrics_address is not None:
        from kvsvc.metrics_http import serve_metrics_http
        from kvsvc.tls import ServerTlsSource, TlsFileError

        try:
            source = ServerTlsSource(metrics_tls) if metrics_tls is not None else None
            metrics_server, _ = serve_metrics_http(*metrics_address, metrics.registry, source)
        except TlsFileError as exc:
            print(f"kvsvc indexer: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # taken since the check
            assert metrics_listener is not None
            error = ListenError(args.metrics_listen, metrics_listener.what, "--metrics-listen", exc)
            print(error.report("kvsvc indexer"), file=sys.stderr)
            return 1
        metrics_port = metrics_server.server_port
    options = IndexerOptions(
        lease_ttl_s=args.lease_ttl,
        purge_after_s=args.purge_after,
        max_batch_events=args.max_batch_events,
        client_options=client_options,
        keys=Keys(args.key_prefix),
        load_interval_s=args.load_interval,
        load_ttl_s=args.load_ttl,
    )
    indexer = Indexer(client, options, metrics)
    indexer.set_sources(sources)
    if args.zmq_source:
        try:
            indexer.add_zmq_sources(args.zmq_source, args.zmq_hash_algo)
        except ImportError as exc:
            indexer.stop()
            print(f"kvsvc indexer: --zmq-source: {exc}", file=sys.stderr)
            return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    watcher = None
    if args.sources_file:
        watcher = threading.Thread(
            target=watch,
            args=(args.sources_file, indexer.set_sources, stop),
            kwargs={"extra": list(args.source)},
            daemon=True,
        )
        watcher.start()
    print(
        f"kvsvc indexer following {len(sources) + len(args.zmq_source)} sources into "
        f"{args.redis}" + (f", metrics on port {metrics_port}" if metrics_port else ""),
        flush=True,
    )
    stop.wait()
    indexer.stop()
    if metrics_server is not None:
        metrics_server.shutdown()
    return 0


# -- kvsvc router ------------------------------------------------------------------------


def add_router_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "router",
        help="serve ClusterIndexService Score and Route from the cluster index on Redis",
        description="Answer ClusterIndexService (gRPC) from the index `kvsvc indexer` keeps "
        "in Redis: Score (per indexed engine, the cached prefix tokens of a prompt) and "
        "Route (the engine a prompt should go to, by its cached prefix and the engines' "
        "live load). Prompts are hashed with the servers' algorithm and --hash-seed-file.",
    )
    _redis_flags(parser)
    _seed_flags(parser)
    add_policy_flags(parser)
    parser.add_argument(
        "--listen",
        default=DEFAULT_ROUTER_LISTEN,
        metavar="HOST:PORT",
        help=f"gRPC address (default {DEFAULT_ROUTER_LISTEN}; port 0: any free one)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer tokens the router accepts, one per line (# comments); none: open",
    )
    tls = parser.add_argument_group("TLS", "A certificate makes the listener TLS.")
    tls.add_argument("--tls-cert", metavar="PEM", help="the listener's certificate chain")
    tls.add_argument("--tls-key", metavar="PEM", help="its private key, unencrypted")
    tls.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates from this CA"
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    parser.set_defaults(func=run_router)


def add_policy_flags(parser: Any) -> None:
    """Route's weights: --config (its [route] table), --prefix-weight, --load-weight,
    --load-floor (read back with :func:`policy_from_args`)."""
    from kvsvc.cluster.route import (
        DEFAULT_LOAD_FLOOR,
        DEFAULT_LOAD_WEIGHT,
        DEFAULT_PREFIX_WEIGHT,
    )

    group = parser.add_argument_group(
        "Route's policy",
        "score = prefix weight x cached tokens - load weight x relative load x prompt "
        "tokens; relative load = load / max(the other engines' mean load, load floor) "
        "(docs/cluster.md, "
        "Routing). Flags win over --config's [route] table.",
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file whose [route] table sets prefix_weight, load_weight, load_floor",
    )
    group.add_argument(
        "--prefix-weight",
        type=float,
        metavar="W",
        help=f"weight of the cached prefix tokens (default {DEFAULT_PREFIX_WEIGHT:g})",
    )
    group.add_argument(
        "--load-weight",
        type=float,
        metavar="W",
        help=f"weight of the load penalty, in prompt lengths (default {DEFAULT_LOAD_WEIGHT:g})",
    )
    group.add_argument(
        "--load-floor",
        type=float,
        metavar="N",
        help="least mean load of the other engines (requests) relative loads are taken "
        "against (default "
        f"{DEFAULT_LOAD_FLOOR:g})",
    )


ROUTE_CONFIG_KEYS = ("prefix_weight", "load_weight", "load_floor")


def policy_from_args(args: argparse.Namespace) -> Any:
    """Route's policy: the defaults, then --config's [route] table, then the flags.

    Raises:
        ValueError: an unreadable or malformed file, an unknown key, or a bad weight (the
            flag or key named).
    """
    import tomllib

    from kvsvc.cluster.route import RoutePolicy
    from kvsvc.errors import InvalidArgument

    values: dict[str, float] = {}
    if args.config:
        try:
            data = tomllib.loads(Path(args.config).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"--config {args.config}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {args.config}: {exc}") from None
        unknown = sorted(set(data) - {"route"})
        table = data.get("route", {})
        if not isinstance(table, dict):
            raise ValueError(f"--config {args.config}: [route] must be a table")
        unknown += [f"route.{k}" for k in sorted(set(table) - set(ROUTE_CONFIG_KEYS))]
        if unknown:
            raise ValueError(
                f"--config {args.config}: unknown keys {', '.join(unknown)} (the [route] "
                f"table takes {', '.join(ROUTE_CONFIG_KEYS)})"
            )
        for key, value in table.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"--config {args.config}: route.{key} must be a number")
            values[key] = float(value)
    for key in ROUTE_CONFIG_KEYS:
        flag = getattr(args, key)
        if flag is not None:
            values[key] = flag
    policy = RoutePolicy(**values)
    try:
        policy.check("route")
    except InvalidArgument as exc:
        flag = "--" + exc.field.removeprefix("route.").replace("_", "-")
        raise ValueError(f"{exc} ({flag}, or the key of --config's [route] table)") from None
    return policy


def _read_tokens(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--token-file {path}: {exc.strerror}") from None
    tokens = [t.strip() for t in lines if t.strip() and not t.strip().startswith("#")]
    if not tokens:
        raise ValueError(f"--token-file {path} holds no token")
    return tokens


def run_router(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import redis
    except ImportError:
        print(f"kvsvc router: {_NO_REDIS}", file=sys.stderr)
        return 2
    from kvsvc.cluster.route import Router
    from kvsvc.cluster.router import create_router
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect
    from kvsvc.ports import Listener, ListenError, check_listeners
    from kvsvc.tls import ServerTls, TlsFileError

    try:
        policy = policy_from_args(args)
        seed = _read_seed(args)
        listener = Listener(
            args.listen, "router gRPC", "--listen", *_host_port(args.listen, "--listen")
        )
        tokens = _read_tokens(args.token_file) if args.token_file else []
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if args.tls_client_ca and not args.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        tls = ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    except ValueError as exc:
        print(f"kvsvc router: {exc}", file=sys.stderr)
        return 2
    try:  # before anything starts; gRPC's own failure is a C-core log line and a traceback
        check_listeners([listener])
    except ListenError as exc:
        print(exc.report("kvsvc router"), file=sys.stderr)
        return 1
    try:
        client = connect(args.redis)
        client.ping()
    except ValueError as exc:
        print(f"kvsvc router: {exc}", file=sys.stderr)
        return 2
    except redis.exceptions.RedisError as exc:
        print(f"kvsvc router: --redis {args.redis}: {exc}", file=sys.stderr)
        return 1
    try:
        scorer = Scorer(client, seed, Keys(args.key_prefix))
        server, port = create_router(scorer, args.listen, tokens, tls, Router(scorer, policy))
    except TlsFileError as exc:
        print(f"kvsvc router: {exc}", file=sys.stderr)
        return 1
    except ListenError as exc:  # taken since the check
        print(exc.report("kvsvc router"), file=sys.stderr)
        return 1
    # The port line last and alone: scripts (and tests) read the port as its last word.
    print(
        f"kvsvc router: Route's policy: prefix weight {policy.prefix_weight:g}, load weight "
        f"{policy.load_weight:g}, load floor {policy.load_floor:g}",
        flush=True,
    )
    print(f"kvsvc router serving on port {port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2.0).wait()
    return 0


# -- kvsvc ctl score ---------------------------------------------------------------------


def add_score_parser(commands: Any) -> None:
    """``kvsvc ctl score``: added to ctl's subcommands."""
    score = commands.add_parser(
        "score",
        help="score a prompt against the cluster index on Redis",
        description="Per indexed engine (HOST:PORT/POOL), how many leading tokens of the "
        "prompt in --tokens-file (whitespace-separated token ids) it has cached, from the "
        'index in Redis. --json prints {"scores": {"HOST:PORT/POOL": cached_tokens, ...}} '
        "with every indexed engine.",
    )
    _redis_flags(score)
    _seed_flags(score)
    score.add_argument("--tokens-file", required=True, metavar="FILE", help="the prompt")
    score.add_argument("--cache-salt", default="", help="the prompt's cache salt, if any")
    score.add_argument("--json", action="store_true", help="print the scores as JSON")


def read_tokens_file(path: str) -> list[int]:
    """Whitespace-separated token ids.

    Raises:
        ValueError: an unreadable file or a word that is not an id in [0, 2^31).
    """
    try:
        words = Path(path).read_text(encoding="utf-8").split()
    except OSError as exc:
        raise ValueError(f"--tokens-file {path}: {exc.strerror}") from None
    tokens = []
    for i, word in enumerate(words):
        if not word.isdigit() or int(word) >= 2**31:
            raise ValueError(
                f"--tokens-file {path}: word {i + 1} ({word[:20]!r}) is not a token id in [0, 2^31)"
            )
        tokens.append(int(word))
    return tokens


def run_score(args: argparse.Namespace) -> int:
    try:
        import redis
    except ImportError:
        print(f"kvsvc ctl: {_NO_REDIS}", file=sys.stderr)
        return 2
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect
    from kvsvc.core.hashing import HashingContext
    from kvsvc.errors import InvalidArgument

    try:
        tokens = read_tokens_file(args.tokens_file)
        seed = _read_seed(args)
        client = connect(args.redis)
        hashing = HashingContext(cache_salt=args.cache_salt) if args.cache_salt else None
        result = Scorer(client, seed, Keys(args.key_prefix)).score(tokens, hashing)
    except (ValueError, InvalidArgument) as exc:
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return 2
    except redis.exceptions.RedisError as exc:
        print(f"kvsvc ctl: --redis {args.redis}: {exc}", file=sys.stderr)
        return 1
    ranked = dict(sorted(result.scores.items(), key=lambda item: (-item[1], item[0])))
    warnings = [
        f"{n} hashes with another seed (give --hash-seed-file)" for n in result.seed_mismatch
    ]
    warnings += [
        f"{n} has KV cache groups the index does not track (Mamba, chunked local or cross "
        "attention): its score is an upper bound"
        for n in result.upper_bound
    ]
    for warning in warnings:
        print(f"kvsvc ctl: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps({"scores": ranked}))
        return 0
    if not ranked:
        print("no engine is indexed")
        return 0
    width = max(len(name) for name in ranked)
    print(f"{'ENGINE':<{width}}  CACHED TOKENS  (prompt: {len(tokens)} tokens)")
    for name, cached in ranked.items():
        print(f"{name:<{width}}  {cached}")
    return 0


# -- kvsvc ctl route ---------------------------------------------------------------------


def add_route_parser(commands: Any) -> None:
    """``kvsvc ctl route``: added to ctl's subcommands."""
    route = commands.add_parser(
        "route",
        help="ask which engine a prompt should go to (Route) from the cluster index on Redis",
        description="The engine (HOST:PORT/POOL) the prompt in --tokens-file should go to, "
        "by its cached prefix and the engines' live load, as `kvsvc router` answers Route: "
        "with the runner-up and the term that decided. --json prints "
        '{"chosen": {...}, "runner_up": {...}, "decided_by": "prefix|load|tie|only", ...}.',
    )
    _redis_flags(route)
    _seed_flags(route)
    add_policy_flags(route)
    route.add_argument("--tokens-file", required=True, metavar="FILE", help="the prompt")
    route.add_argument("--cache-salt", default="", help="the prompt's cache salt, if any")
    route.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="HOST:PORT/POOL",
        help="a candidate (again for more; default: every indexed engine)",
    )
    route.add_argument("--json", action="store_true", help="print the answer as JSON")


def _candidate_json(c: Any) -> dict[str, Any]:
    report = c.report
    return {
        "engine": c.engine,
        "num_cached_tokens": c.cached,
        "load": {
            "reported": report is not None,
            "num_running_requests": report.running if report is not None else None,
            "num_used_blocks": report.used_blocks if report is not None else None,
            "num_blocks": report.num_blocks if report is not None else None,
            "age_seconds": round(c.age_s, 3),
            "num_routed_since_report": c.routed_since,
            "relative_load": c.relative,
        },
        "score": c.score,
    }


def run_route(args: argparse.Namespace) -> int:
    try:
        import redis
    except ImportError:
        print(f"kvsvc ctl: {_NO_REDIS}", file=sys.stderr)
        return 2
    from kvsvc.cluster.route import Router
    from kvsvc.cluster.score import Scorer, TokenPrompt
    from kvsvc.cluster.store import connect
    from kvsvc.core.hashing import HashingContext
    from kvsvc.errors import FailedPrecondition, InvalidArgument

    try:
        policy = policy_from_args(args)
        tokens = read_tokens_file(args.tokens_file)
        seed = _read_seed(args)
        client = connect(args.redis)
        hashing = HashingContext(cache_salt=args.cache_salt) if args.cache_salt else None
        router = Router(Scorer(client, seed, Keys(args.key_prefix)), policy)
        result = router.route(TokenPrompt(tokens, hashing), args.engine or None)
    except (ValueError, InvalidArgument) as exc:
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return 2
    except FailedPrecondition as exc:
        print(f"kvsvc ctl: {exc}", file=sys.stderr)
        return 1
    except redis.exceptions.RedisError as exc:
        print(f"kvsvc ctl: --redis {args.redis}: {exc}", file=sys.stderr)
        return 1
    for name in result.seed_mismatch:
        print(f"kvsvc ctl: warning: {name} hashes with another seed", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {
                    "chosen": _candidate_json(result.chosen),
                    "runner_up": (_candidate_json(result.runner_up) if result.runner_up else None),
                    "decided_by": result.decided_by,
                    "num_prompt_tokens": result.num_prompt_tokens,
                    "num_candidates": result.num_candidates,
                    "policy": {
                        "prefix_weight": policy.prefix_weight,
                        "load_weight": policy.load_weight,
                        "load_floor": policy.load_floor,
                    },
                }
            )
        )
        return 0

    def line(role: str, c: Any) -> str:
        load = f"{c.report.running} running" if c.report is not None else "no fresh load report"
        return (
            f"{role:<10} {c.engine}  cached {c.cached} tokens, {load}, relative load "
            f"{c.relative:.2f}, score {c.score:.0f}"
        )

    print(line("chosen", result.chosen))
    if result.runner_up is not None:
        print(line("runner-up", result.runner_up))
    print(
        f"decided by: {result.decided_by}  ({result.num_candidates} candidates, prompt "
        f"{result.num_prompt_tokens} tokens)"
    )
    return 0
