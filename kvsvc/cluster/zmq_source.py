"""vLLM's own ZMQ KV event streams as index sources (``kvsvc indexer --zmq-source``).

An engine that does not use kvsvc (stock vLLM with ``--kv-events-config``, or kvsvc's own
``--kv-events-zmq`` publisher) sends ``[topic, seq (8 bytes big-endian), msgpack
KVEventBatch]`` on a PUB socket (:mod:`kvsvc.integrations.vllm.events` has the format).
The follower SUBscribes, decodes with the same structs, and writes through the same
:class:`~kvsvc.cluster.store.SourceStore` (lease, sequence guard, bits) as a kvsvc source;
the source is named by its endpoint (``tcp://HOST:PORT``).

What such a stream lacks, and what the follower does instead:

- no snapshot: a first start, a gap or a restarted engine (its sequence goes back) starts
  the source's index empty at that point (blocks cached before are unknown until stored
  again: scores can only be low, never stale). With ``replay`` (the engine's ROUTER
  endpoint) a gap is first asked for from the replay buffer.
- no hashing settings: the algorithm is the operator's (``--zmq-hash-algo``; vLLM must run
  with ``sha256_cbor`` and the same seed for its hashes to be the router's), the block size
  the first BlockStored's. Hashes come as bytes or as 64-bit ints (vLLM's default,
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the hash's last 8 bytes read big-endian): a
  source's blocks are indexed under the whole hash or under those 8 bytes, as its first
  hashed event says (``Tracking.hash_bytes``), and the scorer cuts a prompt's hashes alike.
  A bytes hash on an int source is cut too; an int hash on a bytes source (the engine
  restarted with the other setting) starts the source's index again at that batch.
- no pool description: the groups are learned from the events (vLLM's ``group_idx``,
  ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``, block size), tracked as a
  kvsvc source's are (full attention and sliding windows; other kinds leave the score an
  upper bound); a group first seen later starts the source's index again with it. The
  hash block size is taken to be the smallest block size (vLLM's when they are equal).
- no liveness: a PUB socket is silent both idle and dead, so a ZMQ source is never purged
  for being gone, only when it clears its cache or leaves the sources.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvsvc.cluster.metrics import IndexerMetrics
from kvsvc.cluster.source import IndexerOptions, SourceThread
from kvsvc.cluster.store import (
    MAX_GROUP_INDEX,
    MAX_HASH_BYTES,
    MAX_WINDOW,
    InvalidSource,
    LeaseLost,
    SourceMoved,
    Tracking,
    block_size_problem,
)

_log = logging.getLogger("kvsvc.cluster")

ZMQ_EPOCH = "zmq"
# Milliseconds a SUB waits for a message before the follower renews its lease.
POLL_MS = 500
REPLAY_TIMEOUT_MS = 2000
# Block size assumed until a BlockStored says (it only matters for events before one).
DEFAULT_BLOCK_SIZE = 16


def parse_zmq_source(text: str) -> tuple[str, str | None]:
    """``tcp://HOST:PORT`` or ``tcp://HOST:PORT,replay=tcp://HOST:PORT`` -> (pub, replay).

    Raises:
        ValueError: not a ``tcp://``/``ipc://`` endpoint, or an unknown option.
    """
    pub, _, rest = text.strip().partition(",")
    replay = None
    if rest:
        key, _, value = rest.partition("=")
        if key != "replay" or not value:
            raise ValueError(f"--zmq-source {text!r}: expected ENDPOINT[,replay=ENDPOINT]")
        replay = value
    for endpoint in filter(None, (pub, replay)):
        if not endpoint.startswith(("tcp://", "ipc://")) or "*" in endpoint:
            raise ValueError(
                f"--zmq-source {text!r}: {endpoint!r} is not an endpoint to connect to "
                "(tcp://HOST:PORT or ipc://PATH)"
            )
    if any(c in text for c in "{}"):
        raise ValueError(f"--zmq-source {text!r}: '{{' and '}}' would break the Redis hash tags")
    return pub, replay


def _check_events(events: list[Any]) -> None:
    """Refuse a batch with a field the index cannot hold (checked whole, before any of
    it is applied).

    Raises:
        InvalidSource: naming the event and the field.
    """
    from kvsvc.integrations.vllm.events import AllBlocksCleared, BlockStored

    for i, event in enumerate(events):
        if isinstance(event, AllBlocksCleared):
            continue
        problem = None
        if isinstance(event, BlockStored):
            problem = block_size_problem(event.block_size)
        group = event.group_idx or 0
        if problem is None and not 0 <= group <= MAX_GROUP_INDEX:
            problem = f"group_idx {group} (must be in [0, {MAX_GROUP_INDEX}])"
        if problem is None and isinstance(event, BlockStored):
            window = event.kv_cache_spec_sliding_window
            if window is not None and not 0 <= window <= MAX_WINDOW:
                problem = (
                    f"kv_cache_spec_sliding_window {window} (must be in [0, {MAX_WINDOW}] tokens)"
                )
        if problem is None:
            problem = _hashes_problem(event.block_hashes)
        if problem is not None:
            raise InvalidSource(f"{type(event).__name__} (event {i} of a batch) with {problem}")


def _hashes_problem(hashes: list[Any]) -> str | None:
    """Why ``hashes`` (an event's block hashes) cannot be indexed (None: they can): a
    bytes hash over MAX_HASH_BYTES, or an int outside vLLM's unsigned 64 bits (its int
    hashes are a hash's last 8 bytes read big-endian, never negative)."""
    sizes = [len(h) for h in hashes if isinstance(h, bytes)]
    if sizes and max(sizes) > MAX_HASH_BYTES:
        return f"a block hash of {max(sizes)} bytes (at most {MAX_HASH_BYTES})"
    ints = [h for h in hashes if isinstance(h, int)]
    if ints and (min(ints) < 0 or max(ints) >= 1 << (8 * INT_HASH_BYTES)):
        bad = min(ints) if min(ints) < 0 else max(ints)
        return f"an int block hash {bad} (must be in [0, 2^64))"
    return None


class ZmqFollower(SourceThread):
    """Keeps one ZMQ event stream's part of the index (see the module's docstring).

    Args:
        source: ``tcp://HOST:PORT[,replay=tcp://HOST:PORT]``.
        client: the Redis client.
        options: the indexer's options (lease, batch size, keys).
        metrics: where to count.
        owner: the lease token of this indexer.
        hash_algo: how the engine hashes (``sha256_cbor`` for vLLM).
    """

    def __init__(
        self,
        source: str,
        client: Any,
        options: IndexerOptions,
        metrics: IndexerMetrics,
        owner: str,
        hash_algo: str = "sha256_cbor",
    ) -> None:
        self.endpoint, self.replay = parse_zmq_source(source)
        # caught_up: set once the first message was applied.
        super().__init__(self.endpoint, client, options, metrics, owner, f"zmq-{self.endpoint}")
        self.hash_algo = hash_algo
        # (index, kind, block size, sliding window) of each group seen storing blocks.
        self._groups: dict[int, tuple[int, str, int, int]] = {}

    def _run(self) -> None:
        import redis
        import zmq

        from kvsvc.integrations.vllm.events import KVEventBatch
        from kvsvc.integrations.vllm.events import msgspec as _msgspec

        decoder = _msgspec.msgpack.Decoder(type=KVEventBatch)
        context: Any = zmq.Context.instance()
        self.metrics.sources.labels(self.state_name).inc()
        while not self._stop.is_set():
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.endpoint)
            try:
                if not self._take_lease():
                    self._set_state("standby")
                    self._stop.wait(self.options.lease_ttl_s / 3)
                    continue
                self._set_state("writing")
                self._session(sub, decoder)
            except LeaseLost:
                self._lease_refused()
                self._set_state("standby")
            except InvalidSource as exc:
                sub.close(0)  # nothing more is read from it
                self._quarantine(exc)
            except redis.exceptions.RedisError as exc:
                self.metrics.redis_errors.inc()
                _log.warning("%s: Redis: %s; retrying", self.name, exc)
                self._tracking = None  # start the source afresh: Redis may have lost it
                self._stop.wait(1.0)
            except Exception:  # a payload that does not decode, or a bug: say so, go on
                _log.exception("%s: unexpected error; starting the source again", self.name)
                self.metrics.source_errors.inc()
                self._tracking = None
                self._stop.wait(1.0)
            finally:
                sub.close(0)
        try:
            if self._purge_on_stop and self.store.acquire() != "held":
                self.store.purge()
                self.metrics.purges.labels("removed").inc()
            self.lease.drop()
            self.store.release()
        except (redis.exceptions.RedisError, LeaseLost) as exc:
            _log.warning("%s: stopping: %s", self.name, exc)
        self.metrics.sources.labels(self.state_name).dec()

    def _session(self, sub: Any, decoder: Any) -> None:
        import zmq

        self.store.flush_pending()
        state = self.store.state()
        if state.epoch == ZMQ_EPOCH and state.tracking is not None and self._tracking is None:
            self._tracking, self._seq = state.tracking, state.seq  # resume (restart)
            self._groups = _groups_tracked(state.tracking)
        elif self._tracking is None and self.replay is not None:
            # A first start: what the engine's replay buffer still holds, from its start.
            self._apply(self._replay(1), decoder, replayed=True)
        while not self._stop.is_set():
            # The keeper renews the lease; between two runs, look whether it lapsed.
            if self.lease.lapsed and self._retake() and self._tracking is not None:
                # Taken afresh: if Redis lost the source, start it again from here.
                self.store.flush_pending()
                state = self.store.state()
                if state.epoch != ZMQ_EPOCH or state.seq != self._seq:
                    self._tracking = None
            if not sub.poll(POLL_MS):
                continue
            messages = [sub.recv_multipart()]
            size = 0
            while size < self.options.max_batch_events:
                try:
                    messages.append(sub.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                size += 1
            self._apply(messages, decoder)

    def _begin(self, seq: int, hash_bytes: int = 0) -> None:
        """Start the source's index empty just before ``seq`` (a first start, a gap that
        could not be replayed, a restarted engine, or a group seen for the first time),
        tracking the groups seen so far (:func:`_groups_of`), its blocks indexed under the
        last ``hash_bytes`` bytes of their hashes (0: all)."""
        groups = self._groups or {0: (0, "full_attention", DEFAULT_BLOCK_SIZE, 0)}
        # The stream does not say its hash block size: the smallest block size it is.
        size = min(g[2] for g in groups.values())
        tracking = Tracking.from_groups(sorted(groups.values()), size, self.hash_algo, "")
        tracking.hash_bytes = hash_bytes
        self.store.install(ZMQ_EPOCH, seq - 1, tracking, {})
        self._tracking, self._seq = tracking, seq - 1
        self.metrics.snapshots.labels("new" if seq <= 1 else "gap").inc()

    def _replay(self, start: int) -> list[list[bytes]]:
        """The held messages from index sequence ``start`` on, from the replay socket."""
        import zmq

        if self.replay is None:
            return []
        sock: Any = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay)
        try:
            sock.send_multipart((b"", (start - 1).to_bytes(8, "big")))
            out = []
            while sock.poll(REPLAY_TIMEOUT_MS):
                frames = sock.recv_multipart()
                if frames[-1] == b"" and frames[-2] == (-1).to_bytes(8, "big", signed=True):
                    break
                out.append(frames[1:])
            return out
        finally:
            sock.close(0)

    def _apply(self, messages: list[list[bytes]], decoder: Any, replayed: bool = False) -> None:
        """Decode and apply messages ``[topic, seq, payload]`` in order (``replayed``:
        they come from the replay socket, where what is held already is skipped)."""
        from kvsvc.integrations.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored

        run: list[bytes] = []
        first = last = 0

        def flush() -> None:
            nonlocal run, first, last
            if first and self._tracking is not None:
                try:
                    self.store.apply(ZMQ_EPOCH, first, last, self._tracking, run)
                except SourceMoved:
                    self._tracking = None  # restarted below at the next message
                else:
                    self._seq = last
                    self.metrics.batches.inc(last - first + 1)
                    self.metrics.sequence.labels(self.name).set(last)
                    self.caught_up.set()
            run, first, last = [], 0, 0

        for frames in messages:
            if len(frames) != 3 or len(frames[1]) != 8:
                _log.warning("%s: a message that is not [topic, seq, payload]: skipped", self.name)
                continue
            seq = int.from_bytes(frames[1], "big") + 1  # vLLM counts from 0, the index from 1
            batch = decoder.decode(frames[2])
            _check_events(batch.events)
            position = last if first else self._seq
            if self._tracking is not None and seq <= position:
                if replayed:
                    continue  # the replay's part we hold already
                # A live PUB never sends a sequence twice: the engine restarted.
                flush()
                self._tracking = None
            hash_bytes = _hash_bytes_of(batch)
            if (
                self._tracking is not None
                and hash_bytes == INT_HASH_BYTES
                and self._tracking.hash_bytes != INT_HASH_BYTES
            ):
                # Int hashes where bytes came before: the engine restarted with vLLM's
                # default; what the index holds under whole hashes cannot be matched.
                flush()
                self._tracking = None
            seen = _groups_of(batch)
            if self._tracking is None:
                self._groups = seen
            elif not seen.keys() <= self._groups.keys():
                # A group not seen before (a hybrid engine whose first batches stored in
                # some groups only): track it too, from here.
                flush()
                self._tracking = None
                self._groups = {**self._groups, **seen}
            if self._tracking is None:
                flush()
                self._begin(seq, hash_bytes)
            elif seq != position + 1:
                flush()
                if not replayed:
                    self._apply(self._replay(self._seq + 1), decoder, replayed=True)
                if seq <= self._seq:
                    continue
                if seq != self._seq + 1:  # not (all) replayed: start again from here
                    assert self._tracking is not None
                    self._begin(seq, self._tracking.hash_bytes)
            if not first:
                first = seq
            last = seq
            stored_n = removed_n = cleared_n = 0
            assert self._tracking is not None
            tracked_groups = self._tracking.tracked_groups
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    run.append(b"C")
                    cleared_n += 1
                    continue
                assert self._tracking is not None
                hashes = _index_keys(event.block_hashes, self._tracking.hash_bytes)
                group = event.group_idx or 0
                tracked = group in tracked_groups
                if isinstance(event, BlockStored):
                    stored_n += len(hashes)
                    if tracked:
                        run.extend(b"S" + bytes([group]) + h for h in hashes)
                elif isinstance(event, BlockRemoved):
                    removed_n += len(hashes)
                    if tracked:
                        run.extend(b"R" + bytes([group]) + h for h in hashes)
            self.metrics.events.labels("stored").inc(stored_n)
            self.metrics.events.labels("removed").inc(removed_n)
            self.metrics.events.labels("cleared").inc(cleared_n)
            self.metrics.lag.labels(self.name).set(max(0.0, time.time() - batch.ts))
        flush()


# vLLM's int hashes: the low 64 bits of the hash, i.e. its last 8 bytes.
INT_HASH_BYTES = 8


def _hash_bytes_of(batch: Any) -> int:
    """How a batch sends hashes: INT_HASH_BYTES for ints, 0 for bytes (or no hash)."""
    for event in batch.events:
        hashes = getattr(event, "block_hashes", None)
        if hashes:
            return INT_HASH_BYTES if isinstance(hashes[0], int) else 0
    return 0


def _groups_of(batch: Any) -> dict[int, tuple[int, str, int, int]]:
    """(index, kind, block size, sliding window) of the groups a batch stores blocks in,
    from vLLM's per-event metadata (an event without a kind: full attention, as from a
    vLLM before hybrid events)."""
    from kvsvc.integrations.vllm.events import BlockStored

    out: dict[int, tuple[int, str, int, int]] = {}
    for event in batch.events:
        if isinstance(event, BlockStored):
            group = event.group_idx or 0
            if group not in out:
                kind = event.kv_cache_spec_kind or "full_attention"
                out[group] = (
                    group,
                    kind,
                    event.block_size,
                    event.kv_cache_spec_sliding_window or 0,
                )
    return out


def _groups_tracked(tracking: Tracking) -> dict[int, tuple[int, str, int, int]]:
    """The groups a stored tracking was made from (kinds as far as it keeps them)."""
    out = {g: (g, "full_attention", tracking.block_size, 0) for g in tracking.groups}
    for c in tracking.classes:
        kind = "sliding_window" if c.window else "full_attention"
        out.update((g, (g, kind, c.block_size, c.window)) for g in c.groups)
    out.update((g, (g, "unknown", tracking.block_size, 0)) for g in tracking.untracked)
    return out


def _index_keys(hashes: list[bytes | int], hash_bytes: int) -> list[bytes]:
    """The keys a source indexes its blocks under: the whole hash, or (an int source) the
    8 big-endian bytes of vLLM's int, which are a bytes hash's last 8."""
    if not hash_bytes:
        return [h for h in hashes if isinstance(h, bytes)]
    return [
        h.to_bytes(INT_HASH_BYTES, "big") if isinstance(h, int) else h[-INT_HASH_BYTES:]
        for h in hashes
    ]
