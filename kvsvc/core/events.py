"""KV cache events: every change to the prefix index, as plain data the caller drains.

The core never publishes anything itself: the block pool appends events to a
:class:`KVEventQueue` and the server drains it (``take``) into its event stream, the way
vLLM's scheduler drains ``BlockPool.take_events``. Each drained batch gets the next sequence
number, so a subscriber can tell whether it missed one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

MEDIUM_GPU = "GPU"


@dataclass(slots=True)
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
            (``block_size`` per hash when it skipped none).
        block_size: tokens per block of the group.
        lora_name: adapter of the request, if any.
        medium: where the blocks live (``"GPU"`` for device memory).
        group_index: KV cache group the blocks belong to.
        group_kind: that group's attention kind (``full_attention``, ``sliding_window``, ...).
        extra_keys: per block, the extra keys its hash covers (tagged as the hasher tags
            them: ``("lora", name, path)``, ``("mm", id, offset)``, ``("cache_salt", s)``,
            ``("prompt_embeds", digest)``), None for a block without any; None as a whole
            when the request has none. vLLM-format events publish them (untagged).
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    medium: str
    group_index: int
    group_kind: str
    extra_keys: list[tuple[Any, ...] | None] | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left the prefix index (evicted for reuse, or dropped by ``evict_blocks``)."""

    block_hashes: list[bytes]
    medium: str
    group_index: int


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix index was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """Events drained together; ``seq`` is 1, 2, 3, ... per pool, ``timestamp`` Unix seconds."""

    seq: int
    timestamp: float
    events: list[KVEvent] = field(default_factory=list)


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
