"""``kvsvc serve``: run the server (flags define one pool; ``--config`` holds several).

Also the composition root: the server's plugins (the vLLM-format KV event publisher) sit
above it, and :func:`build_server` here wires those its config asks for into it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvsvc import native
from kvsvc.server.busy_poll import DEFAULT_MAX_WINDOW_US, loop_factory
from kvsvc.server.config import (
    DEFAULT_EVENT_BUFFER_BYTES,
    DEFAULT_LISTEN,
    DEFAULT_MAX_SUBSCRIBERS,
    DEFAULT_METRICS_LISTEN,
    DEFAULT_SUBSCRIBER_MAX_LAG_BYTES,
    DEFAULT_SUBSCRIBER_WRITE_TIMEOUT_S,
    HASH_ALGOS,
    KV_EVENTS_VLLM_VERSIONS,
    LAYOUTS,
    STATE_SYNCHRONOUS,
    ConfigError,
    ConfigFileError,
    PoolConfig,
    ServerConfig,
    load_config_file,
    server_config_from_dict,
)
from kvsvc.server.kv_events_targets import POOL_PLACEHOLDER
from kvsvc.server.transports.auth import env_tokens, load_credentials
from kvsvc.units import parse_bytes

if TYPE_CHECKING:
    from kvsvc.server.app import KvsvcServer
    from kvsvc.server.plugins import EventSinkFactory

# Collector thresholds of a process that is the server alone: CPython's default
# (700, 10, 10) runs a young collection every few engine calls (a 2048-token admission
# makes hundreds of containers) and a middle one every few dozen.
GC_THRESHOLDS = (20_000, 20, 50)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the kvsvc server",
        description="Run the kvsvc gRPC server: engine, worker and admin services, health, "
        "reflection and a Prometheus /metrics endpoint.",
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--listen",
        action="append",
        metavar="HOST:PORT|unix:PATH",
        help=f"gRPC address (default {DEFAULT_LISTEN}); unix:PATH listens on a Unix-domain "
        "socket (an engine on the same host, e.g. a sidecar); give it again to listen on "
        "both (routers and probes over TCP, the engine over the socket)",
    )
    server.add_argument(
        "--frames-listen",
        action="append",
        metavar="unix:PATH|HOST:PORT",
        help="also serve the unary engine and admin calls over kvsvc's framed transport "
        "here (protos/kvsvc/v1/frames.proto): the same calls without gRPC's per-call "
        "work, for an engine on the same host (clients: target frames:unix:PATH); give it "
        "again for more; TLS on TCP when the server has --tls-cert",
    )
    server.add_argument(
        "--unix-socket-mode",
        metavar="MODE",
        help="file mode of the unix:PATH sockets of --listen and --frames-listen, octal "
        "(default 0600: the server's user alone; 0660 lets its group connect)",
    )
    server.add_argument(
        "--metrics-listen",
        help=f"/metrics address HOST:PORT (default {DEFAULT_METRICS_LISTEN}); 'off' disables",
    )
    server.add_argument("--config", help="TOML or JSON file with server settings and [[pools]]")
    auth = parser.add_argument_group(
        "credentials (secrets come from files or the environment, never from argv)",
        "Each role has its own tokens: engines (the KVCache API), agents (the Worker API), "
        "operators (the Admin API), cluster indexers (the event stream and the index "
        "snapshot). A token file holds one token per line; an engine line may be "
        "'[ENGINE_NAME] TOKEN [pools=POOL,...]': a name gives that engine its own request-id "
        "namespace, pools= lets it use those pools only. Environment: "
        "KVSVC_{AUTH,ENGINE,AGENT,ADMIN,INDEXER}_TOKEN (one token) and "
        "KVSVC_{AUTH,ENGINE,AGENT,ADMIN,INDEXER}_TOKEN_FILE. No token at all: every call is "
        "open.",
    )
    auth.add_argument("--engine-token-file", metavar="FILE", help="engine tokens")
    auth.add_argument("--agent-token-file", metavar="FILE", help="worker-agent tokens")
    auth.add_argument("--admin-token-file", metavar="FILE", help="operator tokens")
    auth.add_argument(
        "--indexer-token-file",
        metavar="FILE",
        help="cluster indexers' tokens (kvsvc indexer: WatchEvents and SnapshotIndex only)",
    )
    auth.add_argument("--auth-token-file", metavar="FILE", help="one token valid for every role")
    auth.add_argument(
        "--auth-token",
        help="one token for every role, on the command line (compatibility only: visible "
        "in ps; prefer --auth-token-file or KVSVC_AUTH_TOKEN)",
    )
    server.add_argument(
        "--max-message-bytes", type=parse_bytes, help="largest message (e.g. 64MiB)"
    )
    server.add_argument(
        "--heartbeat-timeout", type=float, help="seconds before a silent rank degrades its pool"
    )
    server.add_argument("--event-buffer", type=int, help="event batches kept per pool for replay")
    server.add_argument(
        "--event-buffer-bytes",
        type=parse_bytes,
        help="bytes of event batches kept per pool for replay "
        f"(default {DEFAULT_EVENT_BUFFER_BYTES // 2**20}MiB)",
    )
    server.add_argument(
        "--subscriber-write-timeout",
        type=float,
        metavar="SECONDS",
        help="end a WatchEvents stream (RESOURCE_EXHAUSTED) whose write has not completed "
        f"after this long: it stopped reading (default {DEFAULT_SUBSCRIBER_WRITE_TIMEOUT_S:g}"
        "; 0 never)",
    )
    server.add_argument(
        "--busy-poll-us",
        type=int,
        metavar="US",
        help="poll up to this long for the next call before the event loop sleeps: calls "
        "that come back to back find the server awake; the window closes by itself when "
        f"calls come further apart (default {DEFAULT_MAX_WINDOW_US}; 0 never polls)",
    )
    server.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )
    state = parser.add_argument_group(
        "state (config keys state_dir, state_synchronous, state_snapshot_every, ...)",
        "With a state directory every pool keeps its plan, hash seed, block pool, prefix "
        "index, live requests and event sequence there (SQLite, WAL mode), each change on "
        "disk before its reply leaves: a restart, even after a kill -9, serves the same "
        "block tables, prefix hits and event sequence as before.",
    )
    state.add_argument("--state-dir", metavar="DIR", help="keep the pools' state in DIR")
    state.add_argument(
        "--state-synchronous",
        choices=STATE_SYNCHRONOUS,
        help="normal (default): a process crash loses nothing acknowledged, a power loss "
        "the last second's changes; full: a disk sync per commit, a power loss loses nothing",
    )
    state.add_argument(
        "--restore",
        action="append",
        default=[],
        metavar="FILE",
        help="start a pool from a snapshot file of `kvsvc ctl snapshot`, with the settings "
        "it was made with (flags and the config file may give those that do not change "
        "its plan); with --state-dir it becomes the pool's state there; repeat for several "
        "pools",
    )

    tls = parser.add_argument_group(
        "TLS (config keys tls_cert, tls_key, tls_client_ca)",
        "With a certificate and key the gRPC port and /metrics serve TLS (HTTPS); with a "
        "client CA both require a client certificate it signed (mTLS). Files are checked at "
        "start (a missing or mismatched one exits 1) and re-read when they change.",
    )
    tls.add_argument("--tls-cert", metavar="PEM", help="server certificate chain")
    tls.add_argument("--tls-key", metavar="PEM", help="its private key (unencrypted)")
    tls.add_argument(
        "--tls-client-ca", metavar="PEM", help="require client certificates signed by this CA"
    )

    events = parser.add_argument_group(
        "vLLM-format KV events (ZMQ; needs the kvsvc[vllm] extra)",
        "Each pool's KV events as vLLM's ZmqEventPublisher sends them (PUB frames: topic, "
        "8-byte big-endian sequence, msgpack KVEventBatch; a ROUTER replay socket), so "
        "consumers written for vLLM read kvsvc unchanged. Every pool is its own publisher, "
        "like a vLLM data-parallel rank: its own sequence (from 0), replay buffer and sockets; "
        "pool i in config order (the --pool flag's pool last) uses the TCP ports + i "
        "(ipc/inproc endpoints get _POOL appended). Publishing runs in a background thread "
        "behind a bounded queue: a slow publisher drops the oldest batches (logged, and a "
        "sequence gap for consumers), it never slows the server. It has no authentication "
        "and carries every engine's token ids and LoRA names: bind it where only trusted "
        "consumers (indexers) reach it.",
    )
    events.add_argument(
        "--kv-events-zmq",
        metavar="ENDPOINT",
        help="PUB endpoint: tcp://*:5557 binds (port 0: any free port, printed at start), "
        "tcp://HOST:PORT connects (vLLM's rule; --kv-events-bind binds it), ipc://PATH binds",
    )
    events.add_argument(
        "--kv-events-bind",
        action="store_true",
        default=None,
        help="bind --kv-events-zmq even when it names a host (vLLM's rule connects to it): "
        "tcp://127.0.0.1:5557 publishes on loopback only",
    )
    events.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        help="ROUTER endpoint (always bound) answering replay requests: send an 8-byte "
        "big-endian start sequence, get every held batch from it, then an end marker",
    )
    events.add_argument(
        "--kv-events-topic",
        metavar="TOPIC",
        help=f"topic frame of every message (default '', vLLM's); {POOL_PLACEHOLDER} is "
        f"replaced by the pool name, e.g. 'kv@node1@{POOL_PLACEHOLDER}'",
    )
    events.add_argument(
        "--kv-events-buffer", type=int, metavar="N", help="batches kept per pool for replay"
    )
    events.add_argument(
        "--kv-events-int-hashes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="block hashes as 64-bit ints, vLLM's default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
        "=1; on unless the config file says kv_events_int_hashes = false); "
        "--no-kv-events-int-hashes: the hash bytes, as vLLM with that variable 0",
    )
    events.add_argument(
        "--kv-events-vllm-version",
        choices=KV_EVENTS_VLLM_VERSIONS,
        help="write the events' bytes as this vLLM release does (default: the newest, "
        f"{KV_EVENTS_VLLM_VERSIONS[-1]}; 0.33 added a field, so 0.32's bytes differ; "
        "consumers of every release decode either)",
    )

    # The pool flags default to None, "not given": a pool restored from a snapshot takes
    # what they leave unset from it (restore_settings), others PoolConfig's defaults.
    pool = parser.add_argument_group(
        "pool (one, defined by flags; with --restore, a flag not given takes the snapshot's "
        "setting)"
    )
    pool.add_argument("--pool", help="pool name")
    pool.add_argument("--world-size", type=int, help="ranks (TP x PP) in the pool (default: 1)")
    pool.add_argument(
        "--block-size", type=int, help="required block-size multiple of attention layers"
    )
    pool.add_argument(
        "--max-model-len",
        type=int,
        help="longest request (default: the model length the agents report; -1 fits memory)",
    )
    pool.add_argument("--hash-algo", choices=HASH_ALGOS, help="default: xxh3_128")
    seed = pool.add_mutually_exclusive_group()
    seed.add_argument(
        "--hash-seed",
        help="seed of the first block's parent hash (visible in ps: prefer --hash-seed-file)",
    )
    seed.add_argument(
        "--hash-seed-file",
        metavar="FILE",
        help="file holding the seed (its first line that is not blank or a # comment): the "
        "secret every server of a cluster shares so a cluster index and its router compute "
        "the same hashes",
    )
    pool.add_argument(
        "--no-prefix-caching", action="store_true", default=None, help="disable prefix caching"
    )
    pool.add_argument("--num-gpu-blocks-override", type=int, help="plan exactly this many blocks")
    pool.add_argument("--gpu-memory-utilization", type=float, help="default: 0.9")
    pool.add_argument("--max-num-batched-tokens", type=int, help="default: 8192")
    pool.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=None)
    pool.add_argument(
        "--prefix-cache-retention-interval",
        type=int,
        metavar="N",
        help="which blocks of sliding-window groups are cached, as vLLM's setting of that "
        "name: 0 (its default) only those a later prefix hit can use, N > 0 also a window "
        "tail per N-token segment, -1 every full block (default: 0)",
    )
    pool.add_argument("--layout", choices=LAYOUTS, help="default: layer_outer")
    pool.add_argument(
        "--max-subscribers",
        type=int,
        help=f"open WatchEvents streams the pool takes (default {DEFAULT_MAX_SUBSCRIBERS})",
    )
    pool.add_argument(
        "--subscriber-max-lag-bytes",
        type=parse_bytes,
        help="how much further behind a WatchEvents subscriber may fall (serialized bytes) "
        f"before it gets a gap marker (default {DEFAULT_SUBSCRIBER_MAX_LAG_BYTES // 2**20}MiB)",
    )
    parser.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> ServerConfig:
    """The server config from ``--config`` plus flags (flags win; the flag pool is added).

    A pool a ``--restore`` file holds takes the settings the flags or the config file leave
    unset from the snapshot, and is added as the snapshot has it when neither names it: a
    snapshot knows its pool, so ``kvsvc serve --restore FILE`` needs no pool flags.

    Raises:
        ConfigError: a bad setting; StateError (a ConfigFileError): a ``--restore`` file
            that cannot be read.
    """
    data: dict[str, Any] = load_config_file(args.config) if args.config else {}
    overrides: dict[str, Any] = {}
    if args.listen:
        overrides["listen"] = ",".join(args.listen)
    if args.metrics_listen:
        overrides["metrics_listen"] = args.metrics_listen  # "off": none (the config's rule)
    if args.frames_listen:
        overrides["frames_listen"] = ",".join(args.frames_listen)
    if args.unix_socket_mode is not None:
        overrides["unix_socket_mode"] = args.unix_socket_mode  # octal text: the config's rule
    overrides.update(env_tokens())
    if args.auth_token:
        overrides["auth_token"] = args.auth_token
    for role in ("auth", "engine", "agent", "admin", "indexer"):
        path = getattr(args, f"{role}_token_file")
        if path:
            overrides[f"{role}_token_file"] = path
    if args.max_message_bytes:
        overrides["max_message_bytes"] = args.max_message_bytes
    if args.heartbeat_timeout:
        overrides["heartbeat_timeout_s"] = args.heartbeat_timeout
    if args.event_buffer:
        overrides["event_buffer_batches"] = args.event_buffer
    if args.event_buffer_bytes:
        overrides["event_buffer_bytes"] = args.event_buffer_bytes
    if args.busy_poll_us is not None:
        overrides["busy_poll_us"] = args.busy_poll_us
    if args.subscriber_write_timeout is not None:
        overrides["subscriber_write_timeout_s"] = args.subscriber_write_timeout
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    if args.state_synchronous:
        overrides["state_synchronous"] = args.state_synchronous
    for flag, key in (
        ("kv_events_zmq", "kv_events_zmq"),
        ("kv_events_replay", "kv_events_replay"),
        ("kv_events_topic", "kv_events_topic"),
        ("kv_events_buffer", "kv_events_buffer_steps"),
    ):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.kv_events_int_hashes is not None:
        overrides["kv_events_int_hashes"] = args.kv_events_int_hashes
    if args.kv_events_vllm_version is not None:
        overrides["kv_events_vllm_version"] = args.kv_events_vllm_version
    if args.kv_events_bind:
        overrides["kv_events_bind"] = True
    for key in ("tls_cert", "tls_key", "tls_client_ca"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    from kvsvc.server.restore import restore_settings  # the state code: only here

    restored = restore_settings(args.restore)
    configured: set[str] = set()
    if isinstance(data.get("pools"), list):
        # A config-file pool that a --restore file holds: its keys win, the snapshot fills in.
        data["pools"] = [
            {**restored[p["name"]][1], **p}
            if isinstance(p, dict) and p.get("name") in restored
            else p
            for p in data["pools"]
        ]
        configured = {str(p.get("name")) for p in data["pools"] if isinstance(p, dict)}
    extra: list[PoolConfig] = []
    if args.pool:
        configured.add(args.pool)
        saved = restored[args.pool][1] if args.pool in restored else {}
        settings = {**saved, **_pool_flags(args)}
        extra.append(PoolConfig(name=args.pool, hash_seed=_hash_seed(args), **settings))
    # A snapshot of a pool configured nowhere else: the pool as the snapshot has it.
    extra += [
        PoolConfig(name=name, **settings)
        for name, (_, settings) in restored.items()
        if name not in configured
    ]
    if extra:
        overrides["extra_pools"] = tuple(extra)
    return server_config_from_dict(data, overrides)


# The flag pool's flags that set the PoolConfig field of their name (None: not given).
POOL_FLAGS = (
    "world_size",
    "block_size",
    "max_model_len",
    "hash_algo",
    "num_gpu_blocks_override",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "disable_hybrid_kv_cache_manager",
    "layout",
    "max_subscribers",
    "subscriber_max_lag_bytes",
    "prefix_cache_retention_interval",
)


def _pool_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flag pool's settings its flags give (None: not given)."""
    given = {name: getattr(args, name) for name in POOL_FLAGS if getattr(args, name) is not None}
    if args.no_prefix_caching:
        given["enable_prefix_caching"] = False
    return given


def _hash_seed(args: argparse.Namespace) -> str | None:
    """The flag pool's seed: ``--hash-seed``, or read from ``--hash-seed-file``.

    Raises:
        ConfigError: the seed file cannot be read or holds no seed.
    """
    if not args.hash_seed_file:
        return args.hash_seed  # type: ignore[no-any-return]
    from kvsvc.core.seed import read_seed_file

    try:
        return read_seed_file(args.hash_seed_file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class EarlyStop:
    """SIGINT/SIGTERM from the process's start until the server's loop takes them over.

    Without it a Ctrl-C in the first second hit whatever was starting: asyncio.run's own
    SIGINT handling cancelled the start half-way (a 52-line traceback, "Event loop is
    closed"), or the cancellation was swallowed and the server ran on, deaf to it. Now the
    first signal is noted and the server, once started, stops at once; a second one exits
    at once (a persisted state survives a kill, so nothing is lost)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        if self.requested:
            print("kvsvc serve: interrupted again while starting: exiting now", file=sys.stderr)
            os._exit(130)
        self.requested = True


def event_sinks_for(config: ServerConfig) -> dict[str, EventSinkFactory]:
    """The event sinks ``config`` asks for, by the setting each serves (the server never
    imports them: :mod:`kvsvc.server.plugins`).

    Raises:
        ImportError: ``kv_events_zmq`` without pyzmq or msgspec (naming ``kvsvc[vllm]``).
    """
    if config.kv_events_zmq is None:
        return {}
    from kvsvc.integrations.vllm.events import ZmqKVEvents

    return {"kv_events_zmq": ZmqKVEvents.attach}


def build_server(config: ServerConfig, **kwargs: Any) -> KvsvcServer:
    """A :class:`~kvsvc.server.app.KvsvcServer` (``kwargs`` as it takes them) with the
    plugins its config asks for."""
    from kvsvc.server.app import KvsvcServer

    return KvsvcServer(config, event_sinks=event_sinks_for(config), **kwargs)


async def create_server(config: ServerConfig, **kwargs: Any) -> tuple[KvsvcServer, int]:
    """:func:`kvsvc.server.app.create_server` with the plugins the config asks for."""
    from kvsvc.server import app

    return await app.create_server(config, event_sinks=event_sinks_for(config), **kwargs)


async def serve(
    config: ServerConfig,
    ready: Any | None = None,
    restore: Sequence[str] = (),
    early_stop: EarlyStop | None = None,
) -> None:
    """Run until SIGINT/SIGTERM, then stop gracefully (a persisted pool ends with a
    snapshot, so the next start replays nothing). ``early_stop``: the signals noted while
    starting (the server stops as soon as it started)."""
    # A restored pool's line is logged by the server (KvsvcServer), once: not printed here.
    server, port = await create_server(config, restore=restore, freeze_gc=True)
    # Logged, not printed: the 'serving' line stays the first line tools read.
    logging.getLogger("kvsvc.server").info("kvsvc %s", native.describe())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if early_stop is not None and early_stop.requested:
        logging.getLogger("kvsvc.server").info("stopped while starting: shutting down")
        await server.stop(grace=1.0)
        return
    # Before the 'serving' line, which tools wait for: by then these are printed too.
    for line in server.event_sinks.describe():
        print(line, flush=True)
    # Unix sockets first, each on its line: tools wait for the 'serving' line (a port, or
    # the socket of a server on sockets only), and by then these are printed too.
    sockets = server.unix_sockets if port else server.unix_sockets[1:]
    for address in sockets:
        print(f"kvsvc listening on {address}", flush=True)
    for address in server.frames_addresses:
        print(f"kvsvc frames on {address}", flush=True)
    print(
        f"kvsvc serving on {f'port {port}' if port else server.unix_sockets[0]}"
        + (f", metrics on port {server.metrics_port}" if server.metrics_port else ""),
        flush=True,
    )
    if ready is not None:
        ready(server)
    await stop.wait()
    logging.getLogger("kvsvc.server").info("shutting down")
    await server.stop(grace=5.0)


def run(args: argparse.Namespace) -> int:
    early_stop = EarlyStop()  # first: a Ctrl-C from here on is handled
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = build_config(args)
        load_credentials(config)  # an unreadable or empty token file stops the start
    except ConfigFileError as exc:  # a TLS file that is missing or wrong: not a bad flag
        print(f"kvsvc serve: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"kvsvc serve: {exc}", file=sys.stderr)
        return 2
    if config.kv_events_zmq is not None:
        try:
            import kvsvc.integrations.vllm.events  # noqa: F401  (pyzmq, msgspec)
        except ImportError as exc:
            print(f"kvsvc serve: {exc}", file=sys.stderr)
            return 2
    # This process is the server alone: fewer collections (GC_THRESHOLDS), and its pools'
    # long-lived objects frozen out of them once planned (freeze_gc in serve()).
    gc.set_threshold(*GC_THRESHOLDS)
    from kvsvc.ports import ListenError

    try:
        with asyncio.Runner(loop_factory=loop_factory(config.busy_poll_us)) as runner:
            runner.run(serve(config, restore=args.restore, early_stop=early_stop))
    except ListenError as exc:  # ports in use: a line for each
        print(exc.report("kvsvc serve"), file=sys.stderr)
        return 1
    except (OSError, ConfigFileError) as exc:  # TLS files gone since the check, ...
        print(f"kvsvc serve: {exc}", file=sys.stderr)
        return 1
    return 0
