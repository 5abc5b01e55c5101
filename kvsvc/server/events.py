"""Per-pool event log: a bounded replay buffer of KV event batches plus live subscribers.

The core numbers batches 1, 2, 3, ...; the log keeps the newest of them within three
bounds (batches, events and bytes, oldest dropped first). A batch is converted to protobuf
and serialized the first time a subscriber needs it, and the bytes are then shared by
every subscriber (the ``WatchEvents`` handler passes them through unchanged, see
:mod:`kvsvc.server.transports.grpc_listener`): a sidecar nobody watches pays nothing for
its events (a decode step that completes a block in each of 256 requests makes 256
events), and a watched one serializes each batch once, not once per subscriber.

Until then a held batch is kept packed: its events as tuples of plain values in one
``marshal`` bytes object (compiled: a Step's 32-event batch is appended in ~9 us, 4 as
objects; protobuf's serialization takes ~90). The garbage collector does not track bytes.
Held as objects (an event, its hash list and token array each), the buffer's up to
200,000 events were most of what the server's collections walked: every young collection
walked the events appended since the one before, 2.4-9 ms every ~1.5 s in rpc_bench, the
calls it interrupted 5-20x their p50, and the rarer older generations walked them all.

A subscriber asks for a start sequence: it gets what is still held, a ``gap`` marker
first when its start was already dropped, then new batches as they arrive. One that asks
for it (``send_caught_up``) gets a ``caught_up`` marker once, when it has been sent the
newest batch: the replay is over. Markers carry sequence 0 (batches start at 1) and the
sequence of the next batch the stream sends.

What a subscriber costs, and the bounds that keep it from slowing the pool (measured on a
2-core machine: the server's time goes to sending, about 25 us of gRPC work per message
per subscriber, all of it on the one event loop the engines' calls run on; 64 subscribers
replaying the buffer cut a writer from ~1,250 Steps/s to ~100-190, 500 to ~20, for as
long as the replay took; 64 that keep up, to ~250-400):

- **Sending is paced.** All subscribers of all pools on the event loop share a
  :class:`SendGate`: writes go out in rounds of a few, and after each round the gate
  pauses twice as long as the round took, so subscribers get at most a third of a busy
  loop and the engines' calls run in the pauses (the same 64 subscribers then leave the
  writer ~75 % of its Steps). A subscriber that the pacing (or its own reading) leaves
  behind falls behind; it never holds the writers up.
- **Lag is bounded** (``max_lag_bytes``): a subscriber whose lag (serialized bytes from
  its position to the newest batch) grew that much past the smallest it had gets a gap
  marker and resumes from the replay within half the bound of the newest batch. A replay
  from an old start may take its time; losing ground is what counts. Subscribers never pin
  the buffer: it drops its oldest batches whoever still wanted them, so a subscriber holds
  back nothing but its one message in flight.
- **Stuck writes are cut** (``write_timeout_s``): a subscriber that stopped reading fills
  its HTTP/2 window and the server's write to it blocks (at no cost per batch, but holding
  a slot); when one write has not completed within the timeout its stream ends with
  RESOURCE_EXHAUSTED naming the sequence to resume from.
- **Subscribers per pool are capped** (``max_subscribers``): the one past the cap gets
  RESOURCE_EXHAUSTED naming the cap and the setting.

(A gRPC Python client that never reads does not push back: its library keeps accepting
messages into its own memory, so to the server it is a fast reader; pacing and the cap
bound what it costs.)
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections import deque
from collections.abc import Awaitable, Callable

from kvsvc.core import KVEventBatch
from kvsvc.errors import InvalidArgument, ResourceExhausted, quoted
from kvsvc.server.config import (
    DEFAULT_EVENT_BUFFER_BYTES,
    DEFAULT_MAX_SUBSCRIBERS,
    DEFAULT_SUBSCRIBER_MAX_LAG_BYTES,
    DEFAULT_SUBSCRIBER_WRITE_TIMEOUT_S,
)
from kvsvc.server.seclog import RateLimitedLog
from kvsvc.server.wire import event_batch_to_pb, pack_events, unpack_events
from kvsvc.v1 import kvcache_pb2 as pb

# Subscriber writes per round of the send gate, and its pause after a round relative to
# how long the round took: under load subscribers get at most a third of the event loop.
SENDS_PER_ROUND = 4
PAUSE_RATIO = 2.0

# Held bytes of a packed or serialized batch beyond its length: the bytes object's header
# and its allocation, the entry with its timestamp and int fields, a deque slot (~380 as
# measured with tracemalloc, rounded up: the bound must never undercount).
_SERIALIZED_OVERHEAD = 448
# Estimated bytes of a batch held as objects (one whose events do not pack, see _pack;
# CPython 3.11, measured with tracemalloc and rounded up): the batch, its entry (with its
# int fields) and event list, and per event its object, hash bytes (33 + length each, plus
# a list slot) and token ids (a list slot and an int object each: 36 bytes; ids below 257
# are shared, so this overestimates).
_BATCH_BYTES = 384
_STORED_BYTES = 256
_REMOVED_BYTES = 144
_CLEARED_BYTES = 16
_HASH_BYTES = 41  # + the hash's length
_TOKEN_BYTES = 36
# Serialized-size estimate of a batch (for lag, before it is serialized): its header with
# the epoch, and per event the fields around its hashes and token ids (medium, group kind:
# ~32 bytes), 2 bytes of framing per hash and 3 bytes per id (varints of ids below 2^21).
_WIRE_BATCH = 64
_WIRE_EVENT = 32
_WIRE_TOKEN = 3


class _Entry:
    """A held batch: packed (or, if its events do not pack, the batch) until a subscriber
    needs it, then only its wire bytes.

    ``start`` is the stream position of the batch: the estimated serialized bytes of every
    batch before it since the log began (lag is measured in these).
    """

    __slots__ = (
        "batch",
        "data",
        "num_events",
        "packed",
        "sequence",
        "size",
        "start",
        "timestamp",
        "wire",
    )

    def __init__(
        self,
        batch: KVEventBatch,
        packed: bytes | None,
        size: int,
        wire: int,
        start: int,
        num_events: int,
    ) -> None:
        self.sequence = batch.seq
        self.timestamp = batch.timestamp
        self.packed = packed
        self.batch: KVEventBatch | None = batch if packed is None else None
        self.data: bytes | None = None
        self.size = size
        self.wire = wire
        self.start = start
        self.num_events = num_events

    def unpacked(self) -> KVEventBatch:
        """The batch as the core made it (its events rebuilt from the packed values)."""
        if self.batch is not None:
            return self.batch
        assert self.packed is not None
        return KVEventBatch(self.sequence, self.timestamp, unpack_events(self.packed))


class SendGate:
    """Paces the writes of every subscriber on one event loop so the engines' calls keep
    most of it, however many subscribers are behind.

    Unpaced, the loop runs every ready callback once per iteration: with many subscribers
    behind it runs a send for each of them (~25 us apiece) between two steps of an
    engine's call, and a new batch wakes every idle subscriber at once. Here a subscriber
    takes a turn before each write. Turns come in rounds of ``per_round``: within a round's
    budget a turn is granted at once, past it the subscriber queues (FIFO; idle
    subscribers join the queue when a batch arrives, :meth:`admit`). After a round the
    gate measures how long the loop took to get through it (the writes, and whatever else
    was ready) and pauses ``pause_ratio`` times that (at most ``MAX_PAUSE_S``) before the
    next: when the loop is saturated subscribers get at most ``1 / (1 + pause_ratio)`` of
    it, and the pauses are when the engines' calls run. Subscribers the pacing leaves
    behind fall behind (and are skipped ahead past ``max_lag_bytes``); they never hold up a
    writer for more than one round.
    """

    MAX_PAUSE_S = 0.01

    def __init__(self, loop: asyncio.AbstractEventLoop, per_round: int, pause_ratio: float) -> None:
        self._loop = loop
        self._per_round = per_round
        self._pause_ratio = pause_ratio
        self._budget = per_round
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._pending = False  # a measurement or a round is scheduled
        self._round_start = 0.0

    def _kick(self) -> None:
        if not self._pending:
            self._pending = True
            self._round_start = self._loop.time()
            self._loop.call_soon(self._measure)

    def _measure(self) -> None:
        """Runs the iteration after a round's writes began: pause in proportion to it."""
        pause = min(self.MAX_PAUSE_S, (self._loop.time() - self._round_start) * self._pause_ratio)
        self._loop.call_later(pause, self._round)

    def _round(self) -> None:
        self._budget = self._per_round
        self._round_start = self._loop.time()
        waiters = self._waiters
        while self._budget and waiters:
            waiter = waiters.popleft()
            if not waiter.done():  # a cancelled subscriber gave up its place
                waiter.set_result(None)
                self._budget -= 1
        if self._budget < self._per_round or waiters:
            self._loop.call_soon(self._measure)
        else:
            self._pending = False

    def admit(self, waiters: list[asyncio.Future[None]]) -> None:
        """Queue ``waiters`` (idle subscribers a new batch woke); each is resolved in turn."""
        self._waiters.extend(waiters)
        self._kick()

    async def turn(self) -> None:
        """Return when this subscriber may start its next write."""
        if self._budget > 0 and not self._waiters:
            self._budget -= 1
            self._kick()
            return
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        self._kick()
        await waiter


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SendGate] = weakref.WeakKeyDictionary()


def send_gate(loop: asyncio.AbstractEventLoop) -> SendGate:
    """The gate shared by every subscriber on ``loop`` (one per server: all its pools)."""
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = SendGate(loop, SENDS_PER_ROUND, PAUSE_RATIO)
    return gate


class _Subscriber:
    """One open stream, as the write-timeout sweep sees it."""

    __slots__ = ("cut", "peer", "task", "writing_since")

    def __init__(self, task: asyncio.Task[object] | None, peer: str) -> None:
        self.task = task
        self.peer = peer
        self.writing_since = 0.0  # loop time the current write began; 0 when not writing
        self.cut = False


Write = Callable[[bytes], Awaitable[None]]


class EventLog:
    """Holds at most ``capacity`` batches, ``max_events`` events and ``max_bytes`` bytes
    (oldest dropped first; the newest batch is always held), and serves subscribers.

    Attributes:
        num_subscribers: open streams.
        num_refused: streams refused at ``max_subscribers``.
        num_lagged: gap markers sent to subscribers that fell ``max_lag_bytes`` behind.
        num_cut: streams ended because a write did not complete within ``write_timeout_s``.
    """

    def __init__(
        self,
        capacity: int,
        max_events: int = 200_000,
        max_bytes: int = DEFAULT_EVENT_BUFFER_BYTES,
        *,
        max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
        max_lag_bytes: int = DEFAULT_SUBSCRIBER_MAX_LAG_BYTES,
        write_timeout_s: float = DEFAULT_SUBSCRIBER_WRITE_TIMEOUT_S,
        pool: str = "",
    ) -> None:
        self.epoch = uuid.uuid4().hex
        self._batches: deque[_Entry] = deque()
        self._capacity = capacity
        self._max_events = max_events
        self.max_bytes = max_bytes
        self.max_subscribers = max_subscribers
        self.max_lag_bytes = max_lag_bytes
        self.write_timeout_s = write_timeout_s
        self.pool = pool
        self._num_events = 0
        self._held_bytes = 0
        self._stream_bytes = 0  # estimated serialized bytes of every batch appended
        self._last_seq = 0
        # Subscribers waiting for the next batch, and the loop they wait on.
        self._idle: list[asyncio.Future[None]] = []
        self._idle_loop: asyncio.AbstractEventLoop | None = None
        self.num_dropped_batches = 0
        self.num_events_by_type: dict[str, int] = {"stored": 0, "removed": 0, "cleared": 0}
        self.num_subscribers = 0
        self.num_refused = 0
        self.num_lagged = 0
        self.num_cut = 0
        self._subscribers: set[_Subscriber] = set()
        self._sweep: asyncio.TimerHandle | None = None
        self._log = RateLimitedLog()
        self._listeners: list[Callable[[KVEventBatch], None]] = []

    def configure(
        self,
        *,
        pool: str,
        max_bytes: int,
        max_subscribers: int,
        max_lag_bytes: int,
        write_timeout_s: float,
    ) -> None:
        """Apply the server's settings (the pool builds its log before they are known)."""
        self.pool = pool
        self.max_bytes = max_bytes
        self.max_subscribers = max_subscribers
        self.max_lag_bytes = max_lag_bytes
        self.write_timeout_s = write_timeout_s

    def add_listener(self, listener: Callable[[KVEventBatch], None]) -> None:
        """Call ``listener`` with every batch appended from now on, in order, right after the
        change that made it (it runs under the pool's writer lock: it must not block)."""
        self._listeners.append(listener)

    @property
    def last_sequence(self) -> int:
        return self._last_seq

    def restore(self, epoch: str, last_sequence: int) -> None:
        """Continue a saved pool's stream (a restart on its state directory): its epoch,
        and numbering after ``last_sequence``, so subscribers resume without a gap. Only
        before the first batch is appended (the replay buffer starts empty)."""
        assert not self._batches, "restore an event log before it holds batches"
        self.epoch = epoch
        self._last_seq = last_sequence

    @property
    def oldest_sequence(self) -> int:
        """Sequence of the oldest batch held (last + 1 when nothing is held)."""
        return self._batches[0].sequence if self._batches else self._last_seq + 1

    @property
    def held_bytes(self) -> int:
        """Bytes the replay buffer holds (estimated until a batch is serialized)."""
        return self._held_bytes

    @property
    def num_held_batches(self) -> int:
        return len(self._batches)

    def append(self, batch: KVEventBatch) -> None:
        """Add the next batch (its sequence must follow the last one) and wake subscribers."""
        assert batch.seq == self._last_seq + 1, (batch.seq, self._last_seq)
        # One pass over the events (compiled, kvsvc.server.wire.pack_events): packed (see
        # the module's docstring), and the counters and what the sizes that bound the
        # buffer are made of (summed, then priced once: this runs on every change).
        packed, (stored, removed, cleared, hashes, tokens, hash_len) = pack_events(batch.events)
        counts = self.num_events_by_type
        counts["stored"] += stored
        counts["removed"] += removed
        counts["cleared"] += cleared
        if packed is not None:
            size = len(packed) + _SERIALIZED_OVERHEAD
        else:
            size = (
                _BATCH_BYTES
                + _STORED_BYTES * stored
                + _REMOVED_BYTES * removed
                + _CLEARED_BYTES * cleared
                + (_HASH_BYTES + hash_len) * hashes
                + _TOKEN_BYTES * tokens
            )
        wire = (
            _WIRE_BATCH
            + _WIRE_EVENT * (stored + removed + cleared)
            + (hash_len + 2) * hashes
            + _WIRE_TOKEN * tokens
        )
        entry = _Entry(batch, packed, size, wire, self._stream_bytes, len(batch.events))
        self._stream_bytes += wire
        self._batches.append(entry)
        self._num_events += entry.num_events
        self._held_bytes += size
        self._trim()
        self._last_seq = batch.seq
        for listener in self._listeners:
            listener(batch)
        if self._idle:
            assert self._idle_loop is not None
            idle, self._idle = self._idle, []
            send_gate(self._idle_loop).admit(idle)

    def _trim(self) -> None:
        batches = self._batches
        while len(batches) > 1 and (
            len(batches) > self._capacity
            or self._num_events > self._max_events
            or self._held_bytes > self.max_bytes
        ):
            dropped = batches.popleft()
            self._num_events -= dropped.num_events
            self._held_bytes -= dropped.size
            self.num_dropped_batches += 1

    def _data(self, entry: _Entry) -> bytes:
        """The entry's serialized WatchEventsResponse (made once, then shared)."""
        data = entry.data
        if data is None:
            message = event_batch_to_pb(entry.unpacked())
            message.epoch = self.epoch
            data = entry.data = message.SerializeToString()
            entry.batch = entry.packed = None  # the bytes are all a subscriber needs now
            size = len(data) + _SERIALIZED_OVERHEAD
            self._held_bytes += size - entry.size
            entry.size = size
        return data

    def message(self, sequence: int) -> bytes | None:
        """The serialized batch ``sequence`` as subscribers get it, or None if not held."""
        if not self._batches or not self.oldest_sequence <= sequence <= self._last_seq:
            return None
        return self._data(self._batches[sequence - self._batches[0].sequence])

    def _gap(self, resume: int) -> bytes:
        return pb.WatchEventsResponse(
            gap=True, oldest_available_sequence=resume, epoch=self.epoch
        ).SerializeToString()

    def _caught_up(self, next_seq: int) -> bytes:
        return pb.WatchEventsResponse(
            caught_up=True, oldest_available_sequence=next_seq, epoch=self.epoch
        ).SerializeToString()

    def _resume_point(self) -> int:
        """The oldest held sequence within half the lag bound of the newest batch (the
        newest itself when that alone is bigger): where a subscriber skipped ahead resumes,
        far enough from the bound that it does not lag again at once."""
        batches = self._batches
        target = self._stream_bytes - self.max_lag_bytes // 2
        lo, hi = 0, len(batches) - 1
        while lo < hi:  # first entry whose start is at or past the target
            mid = (lo + hi) // 2
            if batches[mid].start < target:
                lo = mid + 1
            else:
                hi = mid
        return batches[lo].sequence

    def _next_message(self, next_seq: int, best: int | None) -> tuple[bytes, int, int, int]:
        """What to send a subscriber at ``next_seq`` (<= the last sequence): the batch, or a
        gap marker when it was dropped or the subscriber fell too far behind.

        A subscriber is too far behind when its lag (serialized bytes from the batch to the
        newest) exceeds ``max_lag_bytes`` more than ``best``, the smallest lag it has had
        (None before its first batch): a replay from an old start may take its time, but
        whoever loses that much ground is skipped ahead. A start that was dropped resumes
        at the oldest batch held, a subscriber skipped ahead at :meth:`_resume_point`.

        Returns the message, the sequence it stands for (the batch's, or where the marker
        says to resume), the subscriber's position once it is sent, and the batch's lag
        (-1 for a marker).
        """
        oldest = self.oldest_sequence
        target = max(next_seq, oldest)
        entry = self._batches[target - oldest]
        lag = self._stream_bytes - entry.start
        if best is not None and lag > best + self.max_lag_bytes:
            resume = self._resume_point()
            if resume > target:
                self.num_lagged += 1
                self._log.warning(
                    f"lag:{self.pool}",
                    "WatchEvents subscriber of pool %r fell subscriber_max_lag_bytes=%d "
                    "further behind: gap marker, resumes at sequence %d (was at %d)",
                    self.pool,
                    self.max_lag_bytes,
                    resume,
                    next_seq,
                )
                target = resume
        if target != next_seq:
            return self._gap(target), target, target, -1
        return self._data(entry), next_seq, next_seq + 1, lag

    def _admit(self, peer: str) -> None:
        if self.num_subscribers >= self.max_subscribers:
            self.num_refused += 1
            self._log.warning(
                f"cap:{self.pool}",
                "WatchEvents refused for %s: pool %r has %d subscribers (max_subscribers)",
                peer or "?",
                self.pool,
                self.num_subscribers,
            )
            raise ResourceExhausted(
                f"pool {quoted(self.pool)} already has {self.num_subscribers} WatchEvents "
                f"subscribers, its cap (max_subscribers={self.max_subscribers} in the pool's "
                "config); close a stream or raise the cap"
            )

    def _start_sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sweep is None and self.write_timeout_s > 0:
            self._sweep = loop.call_later(self._sweep_interval(), self._check_writes, loop)

    def _sweep_interval(self) -> float:
        return min(1.0, max(0.01, self.write_timeout_s / 4))

    def _check_writes(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cut every subscriber whose current write began more than the timeout ago."""
        now = loop.time()
        for subscriber in self._subscribers:
            since = subscriber.writing_since
            if since and now - since > self.write_timeout_s and not subscriber.cut:
                subscriber.cut = True
                if subscriber.task is not None:
                    subscriber.task.cancel()
        if self._subscribers:
            self._sweep = loop.call_later(self._sweep_interval(), self._check_writes, loop)
        else:
            self._sweep = None

    async def serve(
        self,
        write: Write,
        from_sequence: int | None,
        epoch: str = "",
        peer: str = "",
        *,
        caught_up: bool = False,
    ) -> None:
        """Send batches from ``from_sequence`` (None: only new ones) through ``write``
        (serialized WatchEventsResponse messages) until cancelled; with ``caught_up``, a
        caught_up marker the first time the subscriber has been sent the newest batch
        (at once when there was nothing to replay), so it knows the replay is over.

        Raises:
            InvalidArgument: ``from_sequence`` is beyond the next sequence of this epoch.
            ResourceExhausted: the pool has ``max_subscribers`` already; or a write did not
                complete within ``write_timeout_s`` (the message says where to resume).
        """
        restarted = bool(epoch) and epoch != self.epoch
        if restarted:
            # The subscriber's numbers are from another life of this index: say so, then
            # replay everything held.
            from_sequence = self.oldest_sequence
        if from_sequence is None:
            next_seq = self._last_seq + 1
        else:
            if from_sequence > self._last_seq + 1:
                raise InvalidArgument(
                    "from_sequence",
                    f"{from_sequence} is beyond the next sequence number {self._last_seq + 1}",
                )
            next_seq = max(from_sequence, 1)
        self._admit(peer)
        loop = asyncio.get_running_loop()
        gate = send_gate(loop)
        subscriber = _Subscriber(asyncio.current_task(), peer)
        self._subscribers.add(subscriber)
        self.num_subscribers += 1
        self._start_sweep(loop)
        try:
            if restarted:
                await gate.turn()
                await self._write(subscriber, write, self._gap(next_seq), loop)
            best: int | None = None
            owe_caught_up = caught_up
            while True:
                if next_seq > self._last_seq and owe_caught_up:
                    owe_caught_up = False
                    await gate.turn()
                    # Still right if batches came during the turn: they are new, and the
                    # marker names next_seq, the first of them.
                    await self._write(subscriber, write, self._caught_up(next_seq), loop)
                    continue
                if next_seq > self._last_seq:
                    # Woken by the gate when a batch arrives: that is this write's turn.
                    waiter = loop.create_future()
                    self._idle.append(waiter)
                    self._idle_loop = loop
                    await waiter
                else:
                    await gate.turn()
                # Decided after the turn: batches may have been dropped meanwhile.
                data, next_seq, after, lag = self._next_message(next_seq, best)
                if lag >= 0:
                    best = lag if best is None else min(best, lag)
                await self._write(subscriber, write, data, loop)
                next_seq = after
        except asyncio.CancelledError:
            if not subscriber.cut:
                raise
            if subscriber.task is not None:
                subscriber.task.uncancel()
            self.num_cut += 1
            resume = next_seq  # its write was under way: it may not have arrived
            self._log.warning(
                f"cut:{self.pool}",
                "WatchEvents subscriber %s of pool %r cut: a write did not complete within "
                "subscriber_write_timeout_s=%g (it stopped reading)",
                peer or "?",
                self.pool,
                self.write_timeout_s,
            )
            raise ResourceExhausted(
                f"WatchEvents: a write to this subscriber did not complete within "
                f"subscriber_write_timeout_s={self.write_timeout_s:g}; resume with "
                f"from_sequence={resume} (or after the last batch received)"
            ) from None
        finally:
            self._subscribers.discard(subscriber)
            self.num_subscribers -= 1
            if self._idle:  # drop a cancelled wait of this subscriber
                self._idle = [waiter for waiter in self._idle if not waiter.done()]

    @staticmethod
    async def _write(
        subscriber: _Subscriber, write: Write, data: bytes, loop: asyncio.AbstractEventLoop
    ) -> None:
        subscriber.writing_since = loop.time()
        await write(data)
        subscriber.writing_since = 0.0
