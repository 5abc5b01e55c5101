"""vLLM-format KV events: each pool's event batches on a ZMQ PUB socket, as vLLM sends them.

A consumer written for vLLM's ``ZmqEventPublisher`` (a KV-aware router, an indexer) reads
kvsvc unchanged. Per pool, it sees what one vLLM engine would send::

    PUB     [topic, seq: 8 bytes big-endian, payload: msgpack KVEventBatch]
    ROUTER  request  [identity, b"", start seq: 8 bytes big-endian]
            replies  [identity, b"", topic, seq, payload] for every held batch >= start,
                     then [identity, b"", b"", -1 as 8 signed bytes, b""] (the end marker)

``KVEventBatch`` is ``[ts, [event, ...], data_parallel_rank]`` (an array); each event a map
tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``. The structs below
have vLLM's names, fields, field order and msgspec options, so their bytes are the bytes
vLLM's own classes produce and decode; kvsvc does not import vLLM for it. The format
follows the release a server is told (``kv_events_vllm_version``): 0.33 added a 16th
``BlockStored`` field (``lookahead_token_ids``), which alone changes the map header msgspec
writes, so each release's bytes come from its own struct.

Sequence numbers: the pool's event batches are numbered 1, 2, 3, ... (``WatchEvents``); the
ZMQ sequence is that number - 1, so it starts at 0 and steps by one like vLLM's counter, and
a batch the publisher had to drop shows as a gap (which vLLM's consumers answer with a
replay) instead of being hidden by renumbering.

The server's hot path never waits on ZMQ: a drained batch is appended to a bounded queue
(the oldest is dropped and counted when it is full) and a background thread converts,
encodes, sends and buffers it for replay; a second thread answers replay requests. Each
socket is used by one thread only, as ZMQ requires.

Imported only when ``kv_events_zmq`` is configured (by ``kvsvc serve``, which gives the
server :class:`ZmqKVEvents` as its event sink: :mod:`kvsvc.server.plugins`): it needs pyzmq
and msgspec (the ``kvsvc[vllm]`` extra), and says so when they are missing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvsvc.core import events as kv
from kvsvc.server.config import DEFAULT_KV_EVENTS_MAX_HELD_BYTES, ServerConfig
from kvsvc.server.kv_events_targets import KVEventsTarget, kv_events_targets
from kvsvc.server.plugins import EventSink
from kvsvc.specs import sliding_window_of

if TYPE_CHECKING:
    from kvsvc.server.pool import Pool

try:
    import msgspec
    import zmq
except ImportError as exc:
    raise ImportError(
        f"vLLM-format KV events (--kv-events-zmq) need pyzmq and msgspec ({exc.name} is "
        "missing): install kvsvc[vllm], e.g. pip install 'kvsvc[vllm]'",
        name=exc.name,
    ) from exc

log = logging.getLogger("kvsvc.server.kv_events")

# vLLM's ExternalBlockHash: the hash bytes, or their low 64 bits as an int.
ExternalBlockHash = bytes | int
# The end-of-replay marker's sequence frame.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_INT_HASH_MASK = (1 << 64) - 1


# --------------------------------------------------------------------------- wire types
# Names, field order and options as vllm.distributed.kv_events (0.32): they are the format.


class EventBatch(
    msgspec.Struct,
    array_like=True,  # type: ignore[call-arg]
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
):
    """A batch as a msgpack array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    gc=False,  # type: ignore[call-arg]
    tag=True,  # type: ignore[call-arg]
):
    """An event as a msgpack map tagged with its class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks entered the prefix index. Fields without a default are always sent."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockStoredLookahead(BlockStored, tag="BlockStored"):  # type: ignore[call-arg]
    """vLLM 0.33+'s ``BlockStored``: the tokens beyond each block its hash covers (None
    without lookahead hashing)."""

    lookahead_token_ids: list[list[int]] | None = None


# The BlockStored struct of each release's format (major.minor).
BLOCK_STORED_OF: dict[str, type[BlockStored]] = {
    "0.32": BlockStored,
    "0.33": BlockStoredLookahead,
    "0.34": BlockStoredLookahead,
}
# What a server publishes unless told otherwise: the newest release's bytes (any release's
# consumer decodes them: an unknown field left at its default is not sent).
DEFAULT_VLLM_FORMAT = "0.34"


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix index."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix index was reset."""


class KVEventBatch(EventBatch):
    """What every PUB message's payload decodes to."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --------------------------------------------------------------------------- conversion


def _external(block_hash: bytes, int_hashes: bool) -> ExternalBlockHash:
    # vLLM's maybe_convert_block_hash: the big-endian value's low 64 bits.
    return int.from_bytes(block_hash, "big") & _INT_HASH_MASK if int_hashes else block_hash


def _untagged(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    # vLLM's to_event_extra_keys: ("mm", id, offset) -> (id, offset), (tag, value) -> value.
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)


def to_vllm_batch(
    batch: kv.KVEventBatch,
    sliding_windows: Sequence[int | None] = (),
    *,
    data_parallel_rank: int | None = 0,
    int_hashes: bool = True,
    vllm_format: str = DEFAULT_VLLM_FORMAT,
) -> KVEventBatch:
    """kvsvc's batch as vLLM's block pool words the same changes (in ``vllm_format``'s
    bytes: a key of :data:`BLOCK_STORED_OF`).

    - ``BlockStored``: the same hashes, parent, tokens and group, annotated as vLLM's
      ``KVCacheManager.take_events`` annotates it (``kv_cache_spec_kind``, and
      ``kv_cache_spec_sliding_window`` of the group), with ``extra_keys`` one entry per
      block, untagged (None for a block without any), as vLLM publishes them.
    - ``BlockRemoved``: one event per hash, as vLLM evicts and reports block by block
      (kvsvc groups a step's removals of a group in one event).

    What kvsvc's events do not carry stays unset, as vLLM leaves it when it does not know:
    ``session_id``, ``locality``, ``ownership``. ``lora_id`` is the engine's integer id
    of the adapter when the engine gave one (vLLM on kvsvc does).

    Args:
        batch: one drained batch of a pool.
        sliding_windows: the pool's sliding window per KV cache group (None where the
            group has none), for ``kv_cache_spec_sliding_window``.
        data_parallel_rank: the rank vLLM's publisher stamps on every batch (a kvsvc
            pool is one engine, rank 0).
        int_hashes: hashes as 64-bit ints (vLLM's default), else the hash bytes.
        vllm_format: the release whose bytes to produce.
    """
    stored_class = BLOCK_STORED_OF[vllm_format]
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in batch.events:
        if isinstance(event, kv.BlockStored):
            group = event.group_index
            parent = event.parent_block_hash
            keys = event.extra_keys
            events.append(
                stored_class(
                    block_hashes=[_external(h, int_hashes) for h in event.block_hashes],
                    parent_block_hash=None if parent is None else _external(parent, int_hashes),
                    token_ids=list(event.token_ids),  # msgspec encodes lists, not arrays
                    block_size=event.block_size,
                    lora_id=event.lora_id,
                    medium=event.medium,
                    lora_name=event.lora_name,
                    extra_keys=(
                        [None] * len(event.block_hashes)
                        if keys is None
                        else [_untagged(k) for k in keys]
                    )
                    or None,
                    group_idx=group,
                    kv_cache_spec_kind=event.group_kind,
                    kv_cache_spec_sliding_window=(
                        sliding_windows[group] if group < len(sliding_windows) else None
                    ),
                )
            )
        elif isinstance(event, kv.BlockRemoved):
            events.extend(
                BlockRemoved(
                    block_hashes=[_external(h, int_hashes)],
                    medium=event.medium,
                    group_idx=event.group_index,
                )
                for h in event.block_hashes
            )
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=batch.timestamp, events=events, data_parallel_rank=data_parallel_rank)


def zmq_sequence(batch: kv.KVEventBatch) -> int:
    """The ZMQ sequence of a kvsvc batch: 0 for the pool's first batch, like vLLM's."""
    return batch.seq - 1


# --------------------------------------------------------------------------- publisher


class ZmqEventPublisher:
    """One pool's publisher: PUB socket, optional replay ROUTER, replay buffer, two threads.

    Thread-safety: :meth:`submit` may be called from any thread (the event loop, or the
    executor thread a large step runs in); the sockets belong to the background threads.

    Args:
        target: the pool's endpoints and topic.
        buffer_steps: batches kept for replay.
        hwm: high-water mark of the PUB socket (ZMQ drops beyond it per subscriber).
        max_held_bytes: bytes the PUB socket may hold for a subscriber that does not take
            its messages; past it the socket is reset (see :meth:`_send`).
        max_queue: batches waiting for the publisher thread; beyond it the oldest goes.
        int_hashes: publish hashes as 64-bit ints (vLLM's default), else the bytes.
        vllm_format: the vLLM release whose bytes to publish (``"0.32"`` ... ``"0.34"``).
        data_parallel_rank: stamped on every batch.
        context: the ZMQ context (default: the process's shared one).
    """

    SHUTDOWN_TIMEOUT_S = 1.0
    # ZMQ's own bytes per queued message of ours (three frames' message structures).
    MESSAGE_OVERHEAD = 256
    LINGER_MS = 500
    REPLAY_POLL_MS = 100

    def __init__(
        self,
        target: KVEventsTarget,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_held_bytes: int = DEFAULT_KV_EVENTS_MAX_HELD_BYTES,
        max_queue: int = 100_000,
        int_hashes: bool = True,
        vllm_format: str = DEFAULT_VLLM_FORMAT,
        data_parallel_rank: int | None = 0,
        context: Any | None = None,
    ) -> None:
        self.target = target
        self.endpoint = target.endpoint
        self.replay_endpoint = target.replay_endpoint
        self._topic = target.topic.encode("utf-8")
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._max_held_bytes = max_held_bytes
        # What ZMQ may hold for the subscribers (publisher thread, see _send): bytes sent,
        # and (tracker, bytes sent before it) of the tracked payloads not all took yet.
        self._sent_bytes = self._since_sentinel = 0
        self._sentinels: deque[tuple[Any, int]] = deque()
        self.held_bytes = 0
        self.num_resets = 0
        self._max_queue = max_queue
        self._int_hashes = int_hashes
        self._vllm_format = vllm_format
        self._dp_rank = data_parallel_rank
        self._ctx = context if context is not None else zmq.Context.instance()
        # Hot path <-> publisher thread.
        self._cond = threading.Condition()
        self._queue: deque[tuple[kv.KVEventBatch, Sequence[int | None]]] = deque()
        self._closing = False
        # Publisher thread <-> replay thread.
        self._buffer_lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub: Any = None
        self._replay: Any = None
        self._threads: list[threading.Thread] = []
        self.num_published_batches = 0
        self.num_dropped_batches = 0
        self.num_replay_requests = 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Bind or connect the sockets and start the threads.

        Raises:
            OSError: a socket could not be bound or connected (nothing is left open).
        """
        try:
            self._pub = self._new_pub()
            if self.target.binds:
                self._pub.bind(self.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for one whole replay and its end marker per client (a ROUTER drops
                # what exceeds it), twice over as vLLM 0.33 sets it: ZMQ acknowledges
                # reads only every HWM/2 messages, so up to HWM/2 may look unread.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
                self._replay.bind(self.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets(linger=0)
            raise OSError(
                f"kv events of pool {self.target.pool!r}: cannot open {self.endpoint}"
                + (f" / {self.replay_endpoint}" if self.replay_endpoint else "")
                + f": {exc}"
            ) from None
        name = self.target.pool
        self._threads = [
            threading.Thread(target=self._publish_loop, name=f"kv-events-{name}", daemon=True)
        ]
        if self._replay is not None:
            self._threads.append(
                threading.Thread(
                    target=self._replay_loop, name=f"kv-events-replay-{name}", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Send what is queued (for up to ``SHUTDOWN_TIMEOUT_S``), then close the sockets."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(self.SHUTDOWN_TIMEOUT_S)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            # A socket may only be closed by the thread using it: leave those to exit.
            log.warning("kv events of pool %r: threads still busy at shutdown: %s", alive)
            return
        with self._cond:
            if self._queue:
                log.warning(
                    "kv events of pool %r: %d batches unsent at shutdown",
                    self.target.pool,
                    len(self._queue),
                )
        self._close_sockets(self.LINGER_MS)

    def _close_sockets(self, linger: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger)
        self._pub = self._replay = None

    # -- hot path ----------------------------------------------------------------------

    def submit(self, batch: kv.KVEventBatch, sliding_windows: Sequence[int | None] = ()) -> None:
        """Queue a batch for publishing; never blocks (drops the oldest queued when full)."""
        dropped = 0
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.num_dropped_batches += 1
                dropped = self.num_dropped_batches
            self._queue.append((batch, sliding_windows))
            self._cond.notify()
        if dropped and dropped & (dropped - 1) == 0:  # 1, 2, 4, 8, ...: loud but bounded
            log.warning(
                "kv events of pool %r: publisher queue full (%d batches); dropped the oldest "
                "(%d so far); consumers see a sequence gap",
                self.target.pool,
                self._max_queue,
                dropped,
            )

    # -- background threads ------------------------------------------------------------

    def _publish_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing, and everything was sent
                pending = list(self._queue)
                self._queue.clear()
            for batch, windows in pending:
                seq = zmq_sequence(batch)
                try:
                    payload = encoder.encode(
                        to_vllm_batch(
                            batch,
                            windows,
                            data_parallel_rank=self._dp_rank,
                            int_hashes=self._int_hashes,
                            vllm_format=self._vllm_format,
                        )
                    )
                    self._send(seq, payload)
                except Exception:
                    log.exception("kv events of pool %r: batch %d not sent", self.target.pool, seq)
                    continue
                with self._buffer_lock:
                    self._buffer.append((seq, payload))
                self.num_published_batches += 1

    def _send(self, seq: int, payload: bytes) -> None:
        """Publish one payload, keeping what ZMQ holds for its subscribers within
        ``max_held_bytes``.

        ZMQ bounds what it holds for a subscriber that does not take its messages by
        count only (``hwm``, 100,000 by default): 4 such subscribers held 150 MB of small
        batches, big ones would hold far more, and a PUB socket says nothing of its
        subscribers. So every ``max_held_bytes / 64`` bytes one payload goes out
        zero-copy with a tracker, which ZMQ marks done once every subscriber has taken
        it: the bytes sent since the oldest payload not done are what the slowest
        subscriber holds (within one such step). Past the bound the socket is closed and
        opened again on the same endpoint, which frees what it held: the subscribers
        reconnect and see a sequence gap, which vLLM's consumers fill from the replay
        socket. One that reads keeps up; one that stopped stays cut off at the bound.
        """
        parts = (self._topic, seq.to_bytes(8, "big"), payload)
        size = len(payload) + self.MESSAGE_OVERHEAD
        step = max(1 << 16, self._max_held_bytes // 64)
        if self._since_sentinel >= step:
            tracker = self._pub.send_multipart(parts, copy=False, track=True)
            self._sentinels.append((tracker, self._sent_bytes))
            self._since_sentinel = 0
        else:
            self._pub.send_multipart(parts)
        self._sent_bytes += size
        self._since_sentinel += size
        sentinels = self._sentinels
        while sentinels and sentinels[0][0].done:
            sentinels.popleft()
        self.held_bytes = self._sent_bytes - sentinels[0][1] + step if sentinels else 0
        if self.held_bytes > self._max_held_bytes:
            self._reset_pub()

    def _reset_pub(self) -> None:
        """Close the PUB socket and open it again (see :meth:`_send`)."""
        self.num_resets += 1
        if self.num_resets & (self.num_resets - 1) == 0:  # 1, 2, 4, ...: loud but bounded
            log.warning(
                "kv events of pool %r: a subscriber had not taken %d bytes of batches "
                "(kv_events_max_held_bytes: %d); the PUB socket is reset, so subscribers "
                "reconnect and see a sequence gap (reset %d so far)",
                self.target.pool,
                self.held_bytes,
                self._max_held_bytes,
                self.num_resets,
            )
        self._pub.close(linger=0)
        self._sentinels.clear()
        self.held_bytes = self._since_sentinel = 0
        self._pub = self._new_pub()
        for attempt in range(200):
            try:
                if self.target.binds:
                    self._pub.bind(self.endpoint)  # the port it had: subscribers come back
                else:
                    self._pub.connect(self.endpoint)
                return
            except zmq.ZMQError as exc:
                # ZMQ closes the old listener in its own thread: the port frees soon.
                if exc.errno != zmq.EADDRINUSE or attempt == 199:
                    log.error(
                        "kv events of pool %r: cannot open %s again after a reset (%s): "
                        "nothing is published until the server restarts",
                        self.target.pool,
                        self.endpoint,
                        exc,
                    )
                    return
                time.sleep(0.01)

    def _new_pub(self) -> Any:
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.copy_threshold = 0  # a tracked payload is never copied (see _send)
        return pub

    def _replay_loop(self) -> None:
        while not self._closing:
            try:
                if self._replay.poll(self.REPLAY_POLL_MS):
                    self._answer_replay()
            except Exception:
                log.exception("kv events of pool %r: replay request failed", self.target.pool)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning(
                "kv events of pool %r: ignored a replay request of %d frames (want 3: "
                "identity, empty, start sequence)",
                self.target.pool,
                len(frames),
            )
            return
        identity, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        with self._buffer_lock:
            held = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        self.num_replay_requests += 1
        for seq, payload in held:
            self._replay.send_multipart(
                (identity, b"", self._topic, seq.to_bytes(8, "big"), payload)
            )
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))


# --------------------------------------------------------------------------- server glue


class _PoolFeed:
    """Hands every batch of a pool's event log to the pool's ZMQ publisher (an
    :meth:`EventLog.add_listener` listener: each batch once, in order, as it is made)."""

    def __init__(self, pool: Pool, publisher: ZmqEventPublisher) -> None:
        self._pool = pool
        self._publisher = publisher
        self._windows_of: Any = None
        self._windows: tuple[int | None, ...] = ()

    def __call__(self, batch: kv.KVEventBatch) -> None:
        cache = self._pool.cache
        if cache is not self._windows_of:  # once per plan, not per batch
            self._windows_of = cache
            groups = cache.manager.kv_cache_config.kv_cache_groups if cache is not None else ()
            self._windows = tuple(sliding_window_of(g.kv_cache_spec) for g in groups)
        self._publisher.submit(batch, self._windows)


class ZmqKVEvents(EventSink):
    """The vLLM-format publishers of one server, one per pool (see :func:`kv_events_targets`):
    the event sink ``kvsvc serve`` gives the server for ``kv_events_zmq`` (:meth:`attach`
    is its factory)."""

    def __init__(self, publishers: dict[str, ZmqEventPublisher]) -> None:
        self.publishers = publishers

    @classmethod
    def attach(cls, config: ServerConfig, pools: Iterable[Pool]) -> ZmqKVEvents:
        """Give each pool a publisher fed by its event log (call before any event exists)."""
        by_name = {pool.name: pool for pool in pools}
        publishers: dict[str, ZmqEventPublisher] = {}
        for target in kv_events_targets(config):
            pool = by_name[target.pool]
            publisher = ZmqEventPublisher(
                target,
                buffer_steps=config.kv_events_buffer_steps,
                hwm=config.kv_events_hwm,
                max_held_bytes=config.kv_events_max_held_bytes,
                max_queue=config.kv_events_max_queue,
                int_hashes=config.kv_events_int_hashes,
                vllm_format=config.kv_events_vllm_version,
            )
            pool.events.add_listener(_PoolFeed(pool, publisher))
            publishers[target.pool] = publisher
        return cls(publishers)

    def start(self) -> None:
        """Open every pool's sockets.

        Raises:
            OSError: one could not be opened (those already opened are closed again).
        """
        started: list[ZmqEventPublisher] = []
        try:
            for publisher in self.publishers.values():
                publisher.start()
                started.append(publisher)
        except OSError:
            for publisher in started:
                publisher.close()
            raise
        for line in self.describe():
            log.info("%s", line)

    def close(self) -> None:
        for publisher in self.publishers.values():
            publisher.close()

    def describe(self) -> list[str]:
        """One line per pool: where its events go (the actual ports once started)."""
        return [
            f"kvsvc kv events of pool {name} on {p.endpoint}"
            + (f", replay on {p.replay_endpoint}" if p.replay_endpoint else "")
            + f", topic {p.target.topic!r}"
            for name, p in self.publishers.items()
        ]
