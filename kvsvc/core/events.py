"""KV cache events: every change to the prefix index, as plain data the caller drains.

The core never publishes anything itself: the block pool appends events to a
:class:`KVEventQueue` and the server drains it (``take``) into its event stream, the way
vLLM's scheduler drains ``BlockPool.take_events``. Each drained batch gets the next sequence
number, so a subscriber can tell whether it missed one.

A batch is bounded in size (:data:`MAX_BATCH_WIRE_BYTES`, :meth:`KVEventQueue.take_batches`):
one call that stores a lot (a Step admitting hundreds of long prompts) drains into several
consecutive batches, each small enough for any subscriber's default message limit, rather
than one that no subscriber could receive.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

# NOTE (native constructors): the dataclasses made on the hot paths (an event per block a
# decode caches or evicts, a batch per call, an outcome per allocate) write their
# ``__init__`` out (``init=False``). Compiled, the one ``dataclass`` generates stays an
# interpreted function: from compiled code, called with keywords, ~2,300 instructions a
# call (``callgrind``), where a written one compiles to a native constructor (~60 ns).
# ``dataclass`` still gives them ``__eq__``, ``__repr__`` and ``replace``;
# tests/core/test_native_constructors.py checks the compiled build keeps them native.

MEDIUM_GPU = "GPU"
# The most bytes a batch may take as a WatchEventsResponse (estimated from above): a
# quarter of gRPC's default 4 MiB receive limit, so a subscriber in any language with its
# library's defaults receives every batch.
MAX_BATCH_WIRE_BYTES = 1 << 20
# Upper bounds of the wire encoding: a batch's own fields (sequence, timestamp, epoch,
# markers), an event's framing and fixed fields, a varint (a token id < 2^32: 5 bytes), a
# length-delimited field's tag and length, a character (4 bytes of UTF-8).
_WIRE_BATCH = 128
_WIRE_EVENT = 48
_WIRE_VARINT = 5
_WIRE_FIELD = 6
_WIRE_CHAR = 4


@dataclass(slots=True, init=False)
class BlockStored:
    """Blocks entered the prefix index: one caching step of one request in one group,
    worded as vLLM 0.32's block pool words it.

    A step covers the request's blocks from the first not processed yet through the last
    full one. Blocks it skips (null: out of a sliding window; or out of reach of any later
    hit, which vLLM's default retention does not cache) have no hash here, so an event may
    list fewer hashes than its tokens fill, or none.

    Attributes:
        block_hashes: the hashes of the blocks the step cached, in prefix order.
        parent_block_hash: hash of the block before the step's first one (None when the
            step starts at the prompt's first block). It is the request's logical parent
            even when that block was dropped from the table (sliding window).
        token_ids: the tokens of every block the step covered, cached or skipped
            (``block_size`` per hash when it skipped none). An ``array("I")`` from the
            pool: one copy of the request's tokens, not an int object each, which the
            replay log would hold and free one by one (compare as ``list(token_ids)``).
        block_size: tokens per block of the group.
        lora_name: adapter of the request, if any.
        medium: where the blocks live (``"GPU"`` for device memory).
        group_index: KV cache group the blocks belong to.
        group_kind: that group's attention kind (``full_attention``, ``sliding_window``, ...).
        extra_keys: per block, the extra keys its hash covers (tagged as the hasher tags
            them: ``("lora", name, path)``, ``("mm", id, offset)``, ``("cache_salt", s)``,
            ``("prompt_embeds", digest)``), None for a block without any; None as a whole
            when the request has none. vLLM-format events publish them (untagged).
        lora_id: the adapter's integer id as the engine numbers it (vLLM's
            ``lora_int_id``), if the engine gave one.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None
    medium: str
    group_index: int
    group_kind: str
    extra_keys: list[tuple[Any, ...] | None] | None = None
    lora_id: int | None = None

    def __init__(
        self,
        block_hashes: list[bytes],
        parent_block_hash: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        medium: str,
        group_index: int,
        group_kind: str,
        extra_keys: list[tuple[Any, ...] | None] | None = None,
        lora_id: int | None = None,
    ) -> None:
        # Written out (the note at the top): one of these per caching step of a Step.
        self.block_hashes = block_hashes
        self.parent_block_hash = parent_block_hash
        self.token_ids = token_ids
        self.block_size = block_size
        self.lora_name = lora_name
        self.medium = medium
        self.group_index = group_index
        self.group_kind = group_kind
        self.extra_keys = extra_keys
        self.lora_id = lora_id


@dataclass(slots=True, init=False)
class BlockRemoved:
    """Blocks left the prefix index (evicted for reuse, or dropped by ``evict_blocks``)."""

    block_hashes: list[bytes]
    medium: str
    group_index: int

    def __init__(self, block_hashes: list[bytes], medium: str, group_index: int) -> None:
        # Written out (the note at the top): one of these per block a decode evicts.
        self.block_hashes = block_hashes
        self.medium = medium
        self.group_index = group_index


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix index was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True, init=False)
class KVEventBatch:
    """Events drained together; ``seq`` is 1, 2, 3, ... per pool, ``timestamp`` Unix seconds."""

    seq: int
    timestamp: float
    events: list[KVEvent] = field(default_factory=list)

    def __init__(self, seq: int, timestamp: float, events: list[KVEvent] | None = None) -> None:
        # Written out (the note at the top): one per call that changed the index.
        self.seq = seq
        self.timestamp = timestamp
        self.events = [] if events is None else events


class KVEventQueue:
    """Pending events and the batch sequence counter (single-threaded, like the pool)."""

    __slots__ = ("_last_seq", "pending")

    def __init__(self) -> None:
        self.pending: list[KVEvent] = []
        self._last_seq = 0

    @property
    def last_seq(self) -> int:
        return self._last_seq

    def restore(self, last_seq: int) -> None:
        """Continue numbering after ``last_seq`` (a pool loaded from its saved state)."""
        if last_seq < 0:
            raise ValueError(f"an event sequence cannot be negative, got {last_seq}")
        self._last_seq = last_seq

    def append(self, event: KVEvent) -> None:
        self.pending.append(event)

    def take(self) -> KVEventBatch | None:
        """All pending events as the next batch, or None when nothing happened."""
        if not self.pending:
            return None
        events, self.pending = self.pending, []
        self._last_seq += 1
        return KVEventBatch(seq=self._last_seq, timestamp=time.time(), events=events)

    def take_batches(self, max_bytes: int = MAX_BATCH_WIRE_BYTES) -> list[KVEventBatch]:
        """All pending events as the next batches, each at most ``max_bytes`` on the wire
        (:func:`wire_bound`): one batch unless they need more; a run of blocks too large for
        one batch is split into runs that chain (each names the previous one's last hash
        as its parent). The split depends on the events alone, so a replay of the same
        calls numbers its batches the same. Empty when nothing happened."""
        if not self.pending:
            return []
        events, self.pending = self.pending, []
        timestamp = time.time()
        budget = max_bytes - _WIRE_BATCH
        # A loop rather than sum(map(...)): compiled, each wire_bound is then a native
        # call, not one through the generic protocol (~300 instructions an event).
        total = 0
        for event in events:
            total += wire_bound(event)
        if total <= budget:
            self._last_seq += 1
            return [KVEventBatch(seq=self._last_seq, timestamp=timestamp, events=events)]
        batches: list[KVEventBatch] = []
        current: list[KVEvent] = []
        size = 0
        for event in events:
            for piece in _pieces(event, budget):
                cost = wire_bound(piece)
                if current and size + cost > budget:
                    self._last_seq += 1
                    batches.append(KVEventBatch(self._last_seq, timestamp, current))
                    current, size = [], 0
                current.append(piece)
                size += cost
        self._last_seq += 1
        batches.append(KVEventBatch(self._last_seq, timestamp, current))
        return batches


def wire_bound(event: KVEvent) -> int:
    """An upper bound of ``event``'s bytes in a WatchEventsResponse."""
    if type(event) is BlockStored:
        hashes = event.block_hashes
        size = (
            _WIRE_EVENT
            + _WIRE_CHAR * (len(event.lora_name or "") + len(event.medium) + len(event.group_kind))
            + _WIRE_VARINT * len(event.token_ids)
        )
        if hashes:
            size += (len(hashes[0]) + _WIRE_FIELD) * (len(hashes) + 1)  # + the parent
        return size
    if type(event) is BlockRemoved:
        hashes = event.block_hashes
        size = _WIRE_EVENT + _WIRE_CHAR * len(event.medium)
        return size + ((len(hashes[0]) + _WIRE_FIELD) * len(hashes) if hashes else 0)
    return _WIRE_EVENT


def _pieces(event: KVEvent, budget: int) -> Iterator[KVEvent]:
    """``event``, or runs of its blocks that each fit ``budget`` when it does not."""
    size = wire_bound(event)
    if size <= budget or isinstance(event, AllBlocksCleared):
        yield event
        return
    hashes = event.block_hashes
    per_block = max(1, (size - _WIRE_EVENT) // max(1, len(hashes)))
    step = max(1, (budget - _WIRE_EVENT) // per_block)
    if isinstance(event, BlockRemoved):
        for start in range(0, len(hashes), step):
            yield BlockRemoved(hashes[start : start + step], event.medium, event.group_index)
        return
    if len(event.token_ids) != event.block_size * len(hashes):
        # A step that skipped blocks (sparse window retention): which tokens a hash covers
        # is not recorded, so the tokens go out in pieces ahead of one piece with every
        # hash (a consumer that reads hashes sees them all, in order).
        tokens = event.token_ids
        chunk = max(1, (budget - _WIRE_EVENT) // _WIRE_VARINT)
        for start in range(0, len(tokens) - chunk, chunk):
            yield replace(
                event, block_hashes=[], token_ids=tokens[start : start + chunk], extra_keys=None
            )
        last = (max(0, len(tokens) - 1) // chunk) * chunk
        yield replace(event, token_ids=tokens[last:])
        return
    tokens_per_block = event.block_size
    parent = event.parent_block_hash
    for start in range(0, len(hashes), step):
        run = hashes[start : start + step]
        extra = event.extra_keys
        yield replace(
            event,
            block_hashes=run,
            parent_block_hash=parent,
            token_ids=event.token_ids[
                start * tokens_per_block : (start + len(run)) * tokens_per_block
            ],
            extra_keys=None if extra is None else extra[start : start + len(run)],
        )
        parent = run[-1]
