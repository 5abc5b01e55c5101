"""Server and pool configuration: from flags (one pool) or a TOML/JSON file (several).

A config file looks like::

    listen = "0.0.0.0:50051"
    metrics_listen = "0.0.0.0:9400"

    [[pools]]
    name = "llama"
    world_size = 2
    max_model_len = 8192
    hash_algo = "sha256_cbor"

Unknown keys are errors (a typo must not silently fall back to a default).

vLLM-format KV events (``kv_events_zmq`` and the other ``kv_events_*`` keys) give each pool
its own ZMQ publisher; :func:`kvsvc.server.kv_events_targets.kv_events_targets` says where
each pool's goes.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvsvc.keepalive import SERVER_MIN_PING_INTERVAL_S
from kvsvc.ports import DEFAULT_UNIX_SOCKET_MODE, is_unix_address, unix_path
from kvsvc.server.busy_poll import DEFAULT_MAX_WINDOW_US, MAX_WINDOW_US_LIMIT
from kvsvc.server.config_errors import ConfigError, ConfigFileError
from kvsvc.server.kv_events_targets import kv_events_targets
from kvsvc.tls import ServerTls, TlsFileError

HASH_ALGOS = ("xxh3_128", "sha256_cbor")
LAYOUTS = ("layer_outer", "block_outer")
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_METRICS_LISTEN = "127.0.0.1:9400"
# vLLM's own default topic (KVEventsConfig.topic): consumers written for vLLM subscribe to it.
DEFAULT_KV_EVENTS_TOPIC = ""
# The vLLM releases whose KV event bytes a server can publish (kv_events_vllm_version).
KV_EVENTS_VLLM_VERSIONS = ("0.32", "0.33", "0.34")
# What the vLLM-format publisher's PUB socket may hold for subscribers that have not
# taken it (kv_events_max_held_bytes).
DEFAULT_KV_EVENTS_MAX_HELD_BYTES = 64 << 20
# WatchEvents bounds (see kvsvc.server.events for what each protects).
DEFAULT_EVENT_BUFFER_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_SUBSCRIBERS = 64
DEFAULT_SUBSCRIBER_MAX_LAG_BYTES = 4 * 1024 * 1024
DEFAULT_SUBSCRIBER_WRITE_TIMEOUT_S = 30.0
STATE_SYNCHRONOUS = ("normal", "full")
# gRPC calls in flight (see kvsvc.server.transports.gate).
DEFAULT_MAX_INFLIGHT_CALLS = 256
DEFAULT_MAX_INFLIGHT_REQUEST_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_INFLIGHT_AGENT_CALLS = 1024
DEFAULT_MAX_INFLIGHT_STREAMS = 1024
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A gRPC request message being read (see kvsvc.server.transports.gate).
DEFAULT_GRPC_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: a model served by ``world_size`` worker ranks.

    Attributes:
        name: the pool's name; engines and agents name it in every call.
        world_size: ranks (TP x PP) that must register before the pool is planned.
        block_size: if set, every attention layer's block size must be a multiple of it.
        max_model_len: longest request; None = the agents' reported model length; -1 =
            auto-fit to memory.
        hash_algo: ``xxh3_128`` (fast, secret random seed unless ``hash_seed``) or
            ``sha256_cbor`` (vLLM-compatible hashes).
        hash_seed: seed of the first block's parent hash.
        enable_prefix_caching: share identical prefixes between requests.
        num_gpu_blocks_override: plan exactly this many blocks per rank.
        gpu_memory_utilization: when an agent reports only totals (kv_cache_bytes 0), the
            KV cache gets total x utilisation - non-KV usage.
        max_num_batched_tokens: a step's token budget (sizes sliding-window holdings).
        disable_hybrid_kv_cache_manager: allocate local-attention layers like full ones.
        layout: tensor layout of the plan (layer_outer or block_outer).
        max_requests: live requests the pool accepts; an admission beyond it (Allocate,
            or a Step admission) is refused with RESOURCE_EXHAUSTED and changes nothing.
        max_num_blocks: most blocks a plan may give each rank (the null block included,
            as in ``num_gpu_blocks_override``). The manager keeps a few hundred bytes of
            bookkeeping per block, so a rank claiming absurd memory must not make millions
            of them: a plan above it fails (raise it or set num_gpu_blocks_override).
        max_pool_tokens: tokens the pool's live requests may hold together (prompts and
            outputs so far, ~8 bytes of server memory each); an admission or a call that
            would add past it is refused with RESOURCE_EXHAUSTED and changes nothing.
            ``max_requests`` bounds the count only: a request admitted with no tokens
            scheduled holds its whole prompt with no block. None: the larger of 4 x the
            pool's KV capacity in tokens and 256 x max_model_len (vLLM's default
            ``max_num_seqs`` of full-length requests), which an engine's running requests
            stay within (their uncached tokens fit in the blocks; shared prefixes are
            counted per request).
        max_unscheduled_tokens: tokens of the pool's live requests not scheduled yet
            (the part of a prompt beyond what is cached and scheduled, appended tokens not
            computed): an admission or call past it is refused with RESOURCE_EXHAUSTED. An
            engine schedules what it admits (only a chunked prefill's later chunks wait),
            so this keeps a client that admits prompts without scheduling them from using
            up ``max_pool_tokens`` ahead of the engines. None: the larger of the pool's KV
            capacity in tokens and 16 x max_model_len.
        recently_freed: freed request ids remembered (the last ones, per pool) so that a
            Free retried after its reply was lost succeeds with 0 blocks instead of
            NOT_FOUND; about 100 bytes plus the id each. 0 turns it off.
        max_subscribers: open WatchEvents streams the pool takes; the next one is refused
            with RESOURCE_EXHAUSTED (each costs the server ~25 us per batch it is sent).
        subscriber_max_lag_bytes: how much ground a subscriber may lose: its lag (the
            serialized bytes of the batches between it and the newest) may grow this much
            past the smallest it has had (about 0 for one that kept up; a replay from an
            old start may take its time); past it, it gets a gap marker and resumes from
            the replay within half of this of the newest batch.
        prefix_cache_retention_interval: which blocks of sliding-window groups are cached,
            as vLLM's setting of that name: 0 (vLLM's default) only the window's blocks a
            later hit can use (before a prompt's end and shared-prefix junctions); N > 0
            (a multiple of the block size) also a window tail per N-token segment; -1 every
            full block. An engine on the pool must use the same setting.
    """

    name: str
    world_size: int = 1
    block_size: int | None = None
    max_model_len: int | None = None
    hash_algo: str = "xxh3_128"
    hash_seed: str | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    disable_hybrid_kv_cache_manager: bool = False
    layout: str = "layer_outer"
    max_requests: int = 65536
    max_pool_tokens: int | None = None
    max_unscheduled_tokens: int | None = None
    max_num_blocks: int = 4_194_304
    recently_freed: int = 65536
    max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS
    subscriber_max_lag_bytes: int = DEFAULT_SUBSCRIBER_MAX_LAG_BYTES
    prefix_cache_retention_interval: int = 0

    def __post_init__(self) -> None:
        where = f"pool {self.name!r}"
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ConfigError(
                f"pool name {self.name!r}: use letters, digits, '-', '_' or '.' (non-empty)"
            )
        if self.world_size < 1:
            raise ConfigError(f"{where}: world_size must be >= 1, got {self.world_size}")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"{where}: block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len != -1 and self.max_model_len < 1:
            raise ConfigError(
                f"{where}: max_model_len must be positive or -1 (auto-fit), "
                f"got {self.max_model_len}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"{where}: unknown hash_algo {self.hash_algo!r}; valid: {', '.join(HASH_ALGOS)}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(
                f"{where}: num_gpu_blocks_override must be >= 2 (one is the null block)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"{where}: gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"{where}: max_num_batched_tokens must be >= 1")
        if self.layout not in LAYOUTS:
            raise ConfigError(
                f"{where}: unknown layout {self.layout!r}; valid: {', '.join(LAYOUTS)}"
            )
        if self.max_requests < 1:
            raise ConfigError(f"{where}: max_requests must be >= 1")
        for name in ("max_pool_tokens", "max_unscheduled_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
        if self.max_num_blocks < 2:
            raise ConfigError(f"{where}: max_num_blocks must be >= 2 (one is the null block)")
        if (
            self.num_gpu_blocks_override is not None
            and self.num_gpu_blocks_override > self.max_num_blocks
        ):
            raise ConfigError(
                f"{where}: num_gpu_blocks_override {self.num_gpu_blocks_override} exceeds "
                f"max_num_blocks {self.max_num_blocks}; raise max_num_blocks"
            )
        if self.recently_freed < 0:
            raise ConfigError(f"{where}: recently_freed must be >= 0")
        if self.max_subscribers < 1:
            raise ConfigError(f"{where}: max_subscribers must be >= 1")
        if self.subscriber_max_lag_bytes < 4096:
            raise ConfigError(f"{where}: subscriber_max_lag_bytes must be >= 4096")
        if self.prefix_cache_retention_interval < -1:
            raise ConfigError(
                f"{where}: prefix_cache_retention_interval must be -1 (every block), 0 or a "
                f"multiple of the block size, got {self.prefix_cache_retention_interval}"
            )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The whole server.

    Attributes:
        listen: gRPC address: ``host:port`` (port 0 picks a free one) or ``unix:PATH`` (a
            Unix-domain socket, for an engine on the same host: a sidecar); several,
            comma-separated, listen on each (``0.0.0.0:50051,unix:/run/kvsvc/kvsvc.sock``:
            routers and probes over TCP, the pod's engine over the socket).
        metrics_listen: Prometheus ``/metrics`` address, or None (``"off"`` in a config
            file, as ``--metrics-listen off``) for no endpoint.
        frames_listen: addresses of the framed transport (``protos/kvsvc/v1/frames.proto``),
            the same form as ``listen`` (comma-separated ``HOST:PORT`` / ``unix:PATH``), or
            None for none: the unary engine and admin calls without gRPC's per-call
            machinery, for an engine next to the server. TLS on TCP when ``tls_cert`` is
            set, like the gRPC listener.
        frames_max_connections: framed connections past their hello open at once, at
            most (a client opens one per thread that calls concurrently); when the server
            has tokens, only a connection whose hello carried a known one gets a slot.
        frames_max_pending_connections: framed connections that have not said hello yet,
            at most; a new one past it closes the oldest of them.
        frames_hello_timeout_s: a framed connection that has not said hello (TLS
            handshake included) this long after connecting is closed.
        frames_idle_timeout_s: a framed connection that sends nothing this long between
            frames is closed (0: never); kvsvc's clients then open a new one.
        frames_frame_timeout_s: a framed connection that leaves a frame half sent this
            long (from its first byte), or leaves its replies unread this long once they
            fill the socket and 1 MiB more, is closed.
        grpc_max_connections: connections the gRPC listener holds at once (all its
            addresses together); one past it is closed before its handshake. None: 1024, or
            half the process's open-file limit where that is lower (so connections cannot
            use up the descriptors the server needs for its state and its other listeners).
        grpc_handshake_timeout_s: a gRPC connection that has not finished its handshake
            (TLS, HTTP/2's preface) this long after connecting is closed.
        grpc_idle_timeout_s: a gRPC connection with no call in progress this long is closed
            (GOAWAY; 0: never): idle channels, a caller's that never made a call
            included, give their slot back (kvsvc's clients reconnect on their next call).
        unix_socket_mode: the file mode of every Unix socket the server listens on (gRPC's
            and the framed transport's), whatever the umask: connecting needs write
            permission on it. Default 0o600, the server's user alone; 0o660 lets its group
            in (an engine in another container of the pod, sharing a group). A config file
            may write it as an octal string ("0660").
        pools: the pools served (names unique).
        auth_token: one token for every role (compatibility; prefer the per-role token
            files): every kvsvc call must carry ``authorization: Bearer <token>`` (health
            and reflection stay open for probes). See :mod:`kvsvc.server.transports.auth`.
        auth_token_file: a file holding that all-roles token.
        engine_token, agent_token, admin_token, indexer_token: one token of that role only
            (set from the ``KVSVC_<ROLE>_TOKEN`` environment variables, not from argv).
        engine_token_file, agent_token_file, admin_token_file, indexer_token_file: files of
            that role's tokens,
            one per line; an engine line may be ``[ENGINE_NAME] TOKEN [pools=a,b]``: a name
            gives that engine its own request-id namespace, ``pools=`` lets it use those
            pools only (PERMISSION_DENIED on any other; without it, every pool).
        engine_token_pools: the pools ``engine_token`` may use (a list, or "a,b"; from
            ``KVSVC_ENGINE_TOKEN_POOLS``); None: every pool.
        max_message_bytes: largest request or response message.
        heartbeat_timeout_s: a rank silent this long makes its pool DEGRADED.
        event_buffer_batches: event batches kept for WatchEvents replay, per pool.
        event_buffer_events: events kept for replay, per pool (whichever bound is hit first).
        event_buffer_bytes: bytes of batches kept for replay, per pool (a batch counts its
            estimated in-memory size until it is first sent, then its serialized size).
        subscriber_write_timeout_s: a WatchEvents write that has not completed after this
            long (the subscriber stopped reading) ends that stream with RESOURCE_EXHAUSTED
            and frees its slot; 0 never does.
        max_step_operations: operations one Step may carry.
        keepalive_min_ping_interval_s: a client may ping (HTTP/2 keepalive) this often on
            a quiet connection; more often twice over, and the connection is ended
            (GOAWAY too_many_pings). kvsvc's clients ping every 30 s (see
            :mod:`kvsvc.keepalive`).
        max_inflight_calls: the engines' and operators' unary gRPC calls (KVCache and
            Admin services) in flight at once; past it, RESOURCE_EXHAUSTED (see
            kvsvc.server.transports.gate).
        max_inflight_request_bytes: request bytes the server holds, both transports
            together: reserved before a request is read (a gRPC message counts
            ``max_message_bytes`` until it is in, its size is not known before; a framed
            one its frame's size), then held until its call ends. A request waits to be
            read while it would pass this, and a caller (a token; without tokens, a peer
            host) reads one gRPC message at a time (see
            kvsvc.server.transports.budget).
        grpc_read_timeout_s: a gRPC request message whose read, once granted, has not
            completed after this long ends its call RESOURCE_EXHAUSTED.
        max_inflight_agent_calls: the agents' calls in flight, their WatchPlan streams
            included (Worker service).
        max_inflight_streams: the subscribers' streams open at once (WatchEvents,
            SnapshotIndex, SnapshotPool).
        kv_events_zmq: publish each pool's KV events in vLLM's wire format on a ZMQ PUB
            socket at this endpoint (None: off). Bound when it has ``*`` or ``::`` or is
            ``ipc://``/``inproc://``, connected otherwise (vLLM's rule), unless
            ``kv_events_bind``. Pool ``i`` (config order) uses port + ``i`` (see
            :func:`~kvsvc.server.kv_events_targets.kv_events_targets`).
        kv_events_bind: bind ``kv_events_zmq`` even when it names a host, which vLLM's
            rule connects to: ``tcp://127.0.0.1:5557`` then publishes on loopback only.
        kv_events_replay: ROUTER endpoint answering replay requests (always bound).
        kv_events_topic: topic frame of every message; ``{pool}`` becomes the pool name.
        kv_events_buffer_steps: batches each pool keeps for replay (vLLM's buffer_steps).
        kv_events_hwm: ZMQ high-water mark of the PUB socket (messages per subscriber).
        kv_events_max_held_bytes: bytes of batches the PUB socket may hold for a
            subscriber that has not taken them (ZMQ's own bound, kv_events_hwm, counts
            messages of any size); past it the socket is reset: every subscriber
            reconnects and sees a sequence gap (a vLLM consumer replays it), and one that
            stopped reading frees what it held.
        kv_events_max_queue: batches waiting for the publisher thread; past it the oldest
            is dropped (and counted), so a stalled publisher never holds up the server.
        kv_events_int_hashes: publish hashes as 64-bit ints (the low 64 bits of the hash
            read big-endian), as vLLM does by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
            unset or 1); false: the hash bytes, as vLLM with that variable 0.
        kv_events_vllm_version: the vLLM release (``"0.32"``, ``"0.33"``, ``"0.34"``) whose
            bytes the events take (0.33 added a field, which changes the bytes, not what
            a consumer of any release decodes); the newest by default.
        tls_cert / tls_key: PEM certificate chain and unencrypted key: the gRPC listener
            and ``/metrics`` serve TLS (HTTPS) with them; both or neither. Re-read when
            the files change (see :mod:`kvsvc.tls`).
        tls_client_ca: PEM CA bundle; when set, both listeners require a client
            certificate signed by it (mTLS). Needs tls_cert.
        state_dir: keep every pool's state (plan, hash seed, block pool, prefix index, live
            requests, event sequence) in this directory, so a restart loses nothing
            acknowledged (see :mod:`kvsvc.server.persistence`). None: in memory only.
        state_synchronous: ``normal`` (a commit writes SQLite's WAL without a disk sync: a
            crash of the process loses nothing acknowledged, a power loss the changes
            since the last checkpoint) or ``full`` (every commit is synced to disk).
        state_snapshot_every: replay work after which a snapshot replaces the journal,
            in units of about 3 us of replay: 25 per journal row (a call that changed the
            pool), 1 per operation (a Step counts each of its operations) and 1 per 16
            tokens (see :func:`kvsvc.server.persistence.writer.replay_units`).
        state_snapshot_min_interval_s: seconds between two snapshots at least, unless the
            journal holds twice ``state_snapshot_every`` (then one is taken at once), so a
            restart replays well under two seconds whatever the load.
        state_checkpoint_interval_s: seconds between two checkpoints (disk syncs of the
            WAL): in ``normal`` mode, how much a power loss can take back.
        busy_poll_us: the longest the event loop polls for the next call before it
            sleeps, in microseconds (0: it never polls). The window adapts: it opens while
            calls come back to back and closes when they come further apart than this
            (see :mod:`kvsvc.server.busy_poll`).
    """

    pools: tuple[PoolConfig, ...]
    listen: str = DEFAULT_LISTEN
    metrics_listen: str | None = DEFAULT_METRICS_LISTEN
    frames_listen: str | None = None
    frames_max_connections: int = 1024
    frames_max_pending_connections: int = 64
    frames_hello_timeout_s: float = 5.0
    frames_idle_timeout_s: float = 300.0
    frames_frame_timeout_s: float = 30.0
    unix_socket_mode: int = DEFAULT_UNIX_SOCKET_MODE
    grpc_max_connections: int | None = None
    grpc_handshake_timeout_s: float = 5.0
    grpc_idle_timeout_s: float = 60.0
    grpc_read_timeout_s: float = DEFAULT_GRPC_READ_TIMEOUT_S
    auth_token: str | None = None
    auth_token_file: str | None = None
    engine_token: str | None = None
    agent_token: str | None = None
    admin_token: str | None = None
    indexer_token: str | None = None
    engine_token_file: str | None = None
    agent_token_file: str | None = None
    admin_token_file: str | None = None
    indexer_token_file: str | None = None
    engine_token_pools: tuple[str, ...] | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_timeout_s: float = 10.0
    event_buffer_batches: int = 10000
    event_buffer_events: int = 200_000
    event_buffer_bytes: int = DEFAULT_EVENT_BUFFER_BYTES
    subscriber_write_timeout_s: float = DEFAULT_SUBSCRIBER_WRITE_TIMEOUT_S
    max_step_operations: int = 8192
    keepalive_min_ping_interval_s: float = SERVER_MIN_PING_INTERVAL_S
    max_inflight_calls: int = DEFAULT_MAX_INFLIGHT_CALLS
    max_inflight_request_bytes: int = DEFAULT_MAX_INFLIGHT_REQUEST_BYTES
    max_inflight_agent_calls: int = DEFAULT_MAX_INFLIGHT_AGENT_CALLS
    max_inflight_streams: int = DEFAULT_MAX_INFLIGHT_STREAMS
    kv_events_zmq: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = DEFAULT_KV_EVENTS_TOPIC
    kv_events_buffer_steps: int = 10_000
    kv_events_hwm: int = 100_000
    kv_events_max_held_bytes: int = DEFAULT_KV_EVENTS_MAX_HELD_BYTES
    kv_events_bind: bool = False
    kv_events_max_queue: int = 100_000
    kv_events_int_hashes: bool = True
    kv_events_vllm_version: str = KV_EVENTS_VLLM_VERSIONS[-1]
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    state_dir: str | None = None
    state_synchronous: str = "normal"
    state_snapshot_every: int = 200_000
    state_snapshot_min_interval_s: float = 10.0
    state_checkpoint_interval_s: float = 1.0
    busy_poll_us: int = DEFAULT_MAX_WINDOW_US

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError(
                "no pools configured: give --pool NAME or a config file with [[pools]]"
            )
        names = [p.name for p in self.pools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"duplicate pool name(s): {', '.join(duplicates)}")
        listen_addresses(self.listen)
        if self.metrics_listen:
            split_host_port(self.metrics_listen, "metrics_listen")
        if self.frames_listen is not None:
            frames = listen_addresses(self.frames_listen, "frames_listen")
            shared = sorted(
                a
                for a in set(frames) & set(listen_addresses(self.listen))
                if not a.endswith(":0")  # port 0: each listener picks its own
            )
            if shared:
                raise ConfigError(
                    f"frames_listen: {shared[0]} is also a gRPC address (listen); give each "
                    "transport its own"
                )
        if not 1 <= self.frames_max_connections <= 1_000_000:
            raise ConfigError("frames_max_connections must be in [1, 1000000]")
        if not 1 <= self.frames_max_pending_connections <= 1_000_000:
            raise ConfigError("frames_max_pending_connections must be in [1, 1000000]")
        for key in ("frames_hello_timeout_s", "frames_frame_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be positive")
        if self.frames_idle_timeout_s < 0:
            raise ConfigError("frames_idle_timeout_s must be >= 0 (0: never)")
        object.__setattr__(self, "unix_socket_mode", _socket_mode(self.unix_socket_mode))
        if (
            self.grpc_max_connections is not None
            and not 1 <= self.grpc_max_connections <= 1_000_000
        ):
            raise ConfigError("grpc_max_connections must be in [1, 1000000]")
        if not self.grpc_handshake_timeout_s > 0:
            raise ConfigError("grpc_handshake_timeout_s must be positive")
        if self.grpc_idle_timeout_s < 0:
            raise ConfigError("grpc_idle_timeout_s must be >= 0 (0: never)")
        if not self.grpc_read_timeout_s > 0:
            raise ConfigError("grpc_read_timeout_s must be positive")
        self._check_engine_token_pools(names)
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes must be at least 1024")
        if self.heartbeat_timeout_s <= 0:
            raise ConfigError("heartbeat_timeout_s must be positive")
        if self.event_buffer_batches < 1:
            raise ConfigError("event_buffer_batches must be >= 1")
        if self.event_buffer_events < 1:
            raise ConfigError("event_buffer_events must be >= 1")
        if self.event_buffer_bytes < 4096:
            raise ConfigError("event_buffer_bytes must be >= 4096")
        if self.subscriber_write_timeout_s < 0:
            raise ConfigError("subscriber_write_timeout_s must be >= 0 (0: never)")
        if not 1 <= self.max_step_operations <= 1_000_000:
            raise ConfigError("max_step_operations must be in [1, 1000000]")
        if not self.keepalive_min_ping_interval_s > 0:
            raise ConfigError("keepalive_min_ping_interval_s must be positive")
        for key in ("max_inflight_calls", "max_inflight_agent_calls", "max_inflight_streams"):
            if not 1 <= getattr(self, key) <= 1_000_000:
                raise ConfigError(f"{key} must be in [1, 1000000]")
        if self.max_inflight_request_bytes < self.max_message_bytes:
            raise ConfigError(
                "max_inflight_request_bytes must be at least max_message_bytes (a request of "
                "the largest size must be able to run)"
            )
        if type(self.busy_poll_us) is not int or not 0 <= self.busy_poll_us <= MAX_WINDOW_US_LIMIT:
            raise ConfigError(
                f"busy_poll_us must be an integer in [0, {MAX_WINDOW_US_LIMIT}] (microseconds; "
                f"0: never poll), not {self.busy_poll_us!r}"
            )
        self._check_kv_events()
        self._check_tls()
        self._check_state()

    def _check_engine_token_pools(self, known: list[str]) -> None:
        scope = self.engine_token_pools
        if scope is None:
            return
        if isinstance(scope, str):
            scope = tuple(name.strip() for name in scope.split(","))
        if not isinstance(scope, (list, tuple)) or not all(
            isinstance(name, str) and name for name in scope
        ):
            raise ConfigError(f'engine_token_pools must list pool names (or "a,b"), got {scope!r}')
        if not self.engine_token:
            raise ConfigError(
                "engine_token_pools scopes engine_token (KVSVC_ENGINE_TOKEN), which is not "
                "set; scope a token file's line with pools= instead"
            )
        unknown = sorted(set(scope) - set(known))
        if unknown:
            raise ConfigError(
                f"engine_token_pools names {', '.join(map(repr, unknown))}, which the server "
                f"does not serve (pools: {', '.join(sorted(known))})"
            )
        object.__setattr__(self, "engine_token_pools", tuple(scope))

    def _check_state(self) -> None:
        if self.state_dir is not None and (
            not isinstance(self.state_dir, str) or not self.state_dir
        ):
            raise ConfigError(f"state_dir must be a directory path, got {self.state_dir!r}")
        if self.state_synchronous not in STATE_SYNCHRONOUS:
            raise ConfigError(
                f"state_synchronous must be one of {', '.join(STATE_SYNCHRONOUS)}, "
                f"got {self.state_synchronous!r}"
            )
        if not isinstance(self.state_snapshot_every, int) or self.state_snapshot_every < 1:
            raise ConfigError("state_snapshot_every must be an integer >= 1")
        if self.state_snapshot_min_interval_s < 0:
            raise ConfigError("state_snapshot_min_interval_s must be >= 0")
        if self.state_checkpoint_interval_s <= 0:
            raise ConfigError("state_checkpoint_interval_s must be positive")

    def _check_tls(self) -> None:
        """Cert and key together, a client CA only with them, every file usable now."""
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{name} must be a file path, got {value!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_cert is not None else ("tls_key", "tls_cert")
            )
            raise ConfigError(f"{given} needs {missing} (--tls-cert and --tls-key go together)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError(
                "tls_client_ca needs tls_cert and tls_key: client certificates are checked "
                "on a TLS listener"
            )
        tls = self.server_tls()
        if tls is not None:
            try:
                tls.load()
            except TlsFileError as exc:
                raise ConfigFileError(str(exc)) from None

    def server_tls(self) -> ServerTls | None:
        """The listeners' TLS files, or None for plaintext listeners."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        return ServerTls(self.tls_cert, self.tls_key, self.tls_client_ca)

    def _check_kv_events(self) -> None:
        if self.kv_events_zmq is None:
            # Settings of a feature that is off would be silently ignored: refuse them.
            stray = [
                f.name
                for f in fields(self)
                if f.name.startswith("kv_events_")
                and f.name != "kv_events_zmq"
                and getattr(self, f.name) != f.default
            ]
            if stray:
                raise ConfigError(
                    f"{', '.join(stray)} set without kv_events_zmq (--kv-events-zmq ENDPOINT)"
                )
            return
        for name in ("kv_events_zmq", "kv_events_replay", "kv_events_topic"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {value!r}")
        for name in (
            "kv_events_buffer_steps",
            "kv_events_hwm",
            "kv_events_max_queue",
            "kv_events_max_held_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_events_vllm_version not in KV_EVENTS_VLLM_VERSIONS:
            raise ConfigError(
                f"kv_events_vllm_version must be one of {', '.join(KV_EVENTS_VLLM_VERSIONS)} "
                f"(the vLLM releases whose event bytes kvsvc writes), got "
                f"{self.kv_events_vllm_version!r}"
            )
        for name in ("kv_events_int_hashes", "kv_events_bind"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        kv_events_targets(self)  # endpoint syntax, port range and collisions


def _socket_mode(value: object) -> int:
    """``unix_socket_mode`` as an int: given as one, or as an octal string ("0660")."""
    mode = value
    if isinstance(value, str):
        try:
            mode = int(value, 8)
        except ValueError:
            mode = None
    if type(mode) is not int or not 0 <= mode <= 0o777:
        raise ConfigError(
            f'unix_socket_mode must be a file mode such as 0o600 (or the string "0600"), '
            f"got {value!r}"
        )
    if mode & 0o600 != 0o600:
        raise ConfigError(
            f"unix_socket_mode {mode:#o} must let the server's own user read and write "
            "(0o600 at least)"
        )
    return mode


def listen_addresses(listen: str, what: str = "listen") -> list[str]:
    """The addresses of a ``listen`` setting (comma-separated), each checked for form:
    ``HOST:PORT`` or ``unix:PATH``; raises ConfigError naming ``what``."""
    addresses = [a.strip() for a in listen.split(",")]
    if not all(addresses):
        raise ConfigError(f"{what}: an empty address in {listen!r}")
    for address in addresses:
        if is_unix_address(address):
            if not unix_path(address):
                raise ConfigError(f"{what}: expected unix:PATH, got {address!r}")
        else:
            split_host_port(address, what)
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"{what}: an address given twice in {listen!r}")
    return addresses


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 in brackets), raising ConfigError naming ``what``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}: expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (what :func:`split_host_port` splits)."""
    return f"{_bracket(host)}:{port}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# metrics_listen (and --metrics-listen) that turns /metrics off.
METRICS_OFF = "off"


def _build(cls: type, data: dict[str, Any], where: str, also: tuple[str, ...] = ()) -> Any:
    """``cls(**data)``; ``also``: keys the caller took out of ``data`` already (valid,
    so the unknown-key message lists them too)."""
    known = {f.name for f in fields(cls)} | set(also)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (default) or JSON (``.json``) config file into a plain dict."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table/object at the top level")
    return data


def _with_seed_file(pool: dict[str, Any], where: str) -> dict[str, Any]:
    """A pool table's ``hash_seed_file`` (the seed kept out of the config file, as
    ``--hash-seed-file`` keeps it out of argv) read into ``hash_seed``."""
    path = pool.pop("hash_seed_file", None)
    if path is None:
        return pool
    if pool.get("hash_seed") is not None:
        raise ConfigError(f"{where}: give hash_seed or hash_seed_file, not both")
    from kvsvc.core.seed import read_seed_file

    try:
        pool["hash_seed"] = read_seed_file(str(path), what=f"{where}.hash_seed_file")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return pool


def server_config_from_dict(
    data: dict[str, Any], overrides: dict[str, Any] | None = None
) -> ServerConfig:
    """Build a ServerConfig from a config-file dict, with ``overrides`` (flags) on top."""
    data = dict(data)
    pools_data = data.pop("pools", [])
    if not isinstance(pools_data, list):
        raise ConfigError("'pools' must be a list of tables ([[pools]] in TOML)")
    pools = [
        _build(
            PoolConfig,
            _with_seed_file(dict(p), f"pools[{i}]"),
            f"pools[{i}]",
            also=("hash_seed_file",),
        )
        if isinstance(p, dict)
        else None
        for i, p in enumerate(pools_data)
    ]
    if any(p is None for p in pools):
        raise ConfigError("every entry of 'pools' must be a table")
    merged = {**data, **(overrides or {})}
    if merged.get("metrics_listen") == METRICS_OFF:  # as --metrics-listen off
        merged["metrics_listen"] = None
    extra_pools = merged.pop("extra_pools", ())
    return _build(ServerConfig, {**merged, "pools": (*pools, *extra_pools)}, "server config")
