"""Per-pool event log: a bounded replay buffer of KV event batches plus live followers.

The core numbers batches 1, 2, 3, ...; the log keeps the newest ``capacity`` of them. A
batch is converted to protobuf the first time a subscriber needs it and the message is
then shared by every subscriber: a sidecar nobody watches pays nothing for its events
(a decode step that completes a block in each of 256 requests makes 256 events). A
follower asks for a start sequence: it gets what is still held, a ``gap`` marker first
when its start was already dropped, then new batches as they arrive.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable

from kvsvc.core import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvsvc.errors import InvalidArgument
from kvsvc.v1 import kvcache_pb2 as pb


class _Entry:
    """A held batch and, once someone asked for it, its wire form."""

    __slots__ = ("batch", "message", "sequence")

    def __init__(self, batch: KVEventBatch) -> None:
        self.sequence = batch.seq
        self.batch = batch
        self.message: pb.WatchEventsResponse | None = None


class EventLog:
    """Holds at most ``capacity`` batches and ``max_events`` events (oldest dropped first)."""

    def __init__(self, capacity: int, max_events: int = 200_000) -> None:
        self.epoch = uuid.uuid4().hex
        self._batches: deque[_Entry] = deque(maxlen=capacity)
        self._max_events = max_events
        self._num_events = 0
        self._last_seq = 0
        self._wakeup = asyncio.Event()
        self.num_dropped_batches = 0
        self.num_events_by_type: dict[str, int] = {"stored": 0, "removed": 0, "cleared": 0}
        self.num_subscribers = 0
        self._listeners: list[Callable[[KVEventBatch], None]] = []

    def add_listener(self, listener: Callable[[KVEventBatch], None]) -> None:
        """Call ``listener`` with every batch appended from now on, in order, right after the
        change that made it (it runs under the pool's writer lock: it must not block)."""
        self._listeners.append(listener)

    @property
    def last_sequence(self) -> int:
        return self._last_seq

    @property
    def oldest_sequence(self) -> int:
        """Sequence of the oldest batch held (last + 1 when nothing is held)."""
        return self._batches[0].sequence if self._batches else self._last_seq + 1

    def append(self, batch: KVEventBatch) -> None:
        """Add the next batch (its sequence must follow the last one) and wake followers."""
        assert batch.seq == self._last_seq + 1, (batch.seq, self._last_seq)
        batches = self._batches
        if len(batches) == batches.maxlen:
            self._num_events -= len(batches[0].batch.events)
            self.num_dropped_batches += 1
        batches.append(_Entry(batch))
        self._num_events += len(batch.events)
        # A bound on events, not only batches: a step can make hundreds of events.
        while self._num_events > self._max_events and len(batches) > 1:
            self._num_events -= len(batches.popleft().batch.events)
            self.num_dropped_batches += 1
        self._last_seq = batch.seq
        counts = self.num_events_by_type
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts["stored"] += 1
            elif isinstance(event, BlockRemoved):
                counts["removed"] += 1
            elif isinstance(event, AllBlocksCleared):
                counts["cleared"] += 1
        for listener in self._listeners:
            listener(batch)
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()

    def _get(self, sequence: int) -> pb.WatchEventsResponse:
        entry = self._batches[sequence - self._batches[0].sequence]
        if entry.message is None:
            from kvsvc.server.wire import event_batch_to_pb

            entry.message = event_batch_to_pb(entry.batch)
            entry.message.epoch = self.epoch
        return entry.message

    async def follow(
        self, from_sequence: int | None, epoch: str = ""
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        """Yield batches from ``from_sequence`` (None: only new ones) until cancelled.

        Raises:
            InvalidArgument: ``from_sequence`` is beyond the next sequence of this epoch.
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
        self.num_subscribers += 1
        try:
            if restarted:
                yield pb.WatchEventsResponse(
                    gap=True, oldest_available_sequence=next_seq, epoch=self.epoch
                )
            while True:
                if next_seq < self.oldest_sequence:
                    yield pb.WatchEventsResponse(
                        gap=True, oldest_available_sequence=self.oldest_sequence, epoch=self.epoch
                    )
                    next_seq = self.oldest_sequence
                while next_seq <= self._last_seq:
                    if next_seq < self.oldest_sequence:  # dropped while we were sending
                        break
                    yield self._get(next_seq)
                    next_seq += 1
                if next_seq > self._last_seq:
                    await self._wakeup.wait()
        finally:
            self.num_subscribers -= 1
