"""The block pool: reference counts, the free queue in eviction order, and the prefix index.

Blocks are plain ints (``0 .. num_blocks - 1``); their metadata lives in a few flat arrays
instead of one Python object per block, which makes a million-block pool cost tens of bytes
per block and a few milliseconds to build.

The null block (id 0) stands in for table entries a request no longer needs (tokens that left
a sliding window, Mamba states that were superseded). It is never allocated, cached, freed or
evicted, and usage does not count it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import compress
from typing import Any

from kvsvc.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventQueue
from kvsvc.core.free_queue import FreeBlockQueue
from kvsvc.core.hashing import BlockExtraKeys, BlockHash, BlockHashList

NULL_BLOCK_ID = 0
# The prefix index of a group is split into shards (by a hash's last byte: digests are
# uniform there) of about this many entries at most, up to 256 shards. A dict that loses
# and gains entries grows its table again every ~(its size) insertions, copying every entry
# while the call that inserted waits: one dict of an 81,920-block pool's hashes stalled an
# admission for 4-12 ms every ~1,450 admissions (a million-block pool's, far longer). A
# shard of ~1,000 entries regrows in tens of microseconds, as often in all.
_SHARD_ENTRIES = 1024
_MAX_SHARDS = 256
# NOTE: the null block's reference count is a large constant, so the decrement-and-test in
# ``free_blocks`` and the zero test in ``touch`` never see it reach 0: callers may pass table
# entries that are null without filtering them out first.
_NULL_REF_COUNT = 1 << 62


def shard_count(num_blocks: int) -> int:
    """Shards of each group's prefix index in a pool of ``num_blocks``: a power of two, so
    that a hash's shard is its last byte masked."""
    count = 1
    while count < _MAX_SHARDS and count * _SHARD_ENTRIES < num_blocks:
        count *= 2
    return count


def _keys_of_blocks(
    extra_keys: BlockExtraKeys | None, positions: Iterable[int], block_size: int
) -> list[tuple[Any, ...] | None] | None:
    """The extra keys of the blocks at ``positions`` (for events; None when the request
    has none, so the common case costs nothing)."""
    if extra_keys is None:
        return None
    return [extra_keys(i * block_size, (i + 1) * block_size) for i in positions]


class BlockPool:
    """All blocks of one pool, shared by every KV cache group of the model.

    Keeps, per block, a reference count (holders: request block tables and reservations)
    and, for cached blocks, the hash and group they are indexed under. Cached blocks stay
    findable after their last holder frees them (lazy eviction): their hash is dropped only
    when the block is handed out again, or by ``evict_blocks`` / ``reset_prefix_cache``.

    The prefix index maps, per group, a block hash to the blocks holding it. Duplicates are
    allowed (two requests may compute the same block before either is cached) so that block
    tables stay append-only; a lookup returns the earliest cached one. Each group's index
    is split in shards by the hash's last byte, so that no single dict's regrowth stalls a
    call for long on a big pool (see ``_SHARD_ENTRIES``).

    Args:
        num_blocks: blocks in the pool, including the null block.
        enable_caching: whether full blocks enter the prefix index.
        num_groups: KV cache groups sharing the pool (one prefix index each).
        group_kinds: attention kind of each group, for events.
        events: where events go; None disables them.
        medium: the medium reported in events.
        index_shards: shards of each group's prefix index (None: by ``num_blocks``, see
            :func:`shard_count`); any count behaves the same.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        num_groups: int = 1,
        group_kinds: Sequence[str] | None = None,
        events: KVEventQueue | None = None,
        medium: str = "GPU",
        index_shards: int | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least the null block, got {num_blocks}")
        if not 1 <= num_groups <= 255:
            raise ValueError(f"num_groups must be in [1, 255], got {num_groups}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.num_groups = num_groups
        self.group_kinds = (
            list(group_kinds) if group_kinds is not None else ["unknown"] * num_groups
        )
        assert len(self.group_kinds) == num_groups
        self.events = events
        self.medium = medium
        self.null_block_id = NULL_BLOCK_ID

        self.ref_cnt: list[int] = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK_ID] = _NULL_REF_COUNT
        # Hash and group of cached blocks (None / meaningless for the others).
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_group = bytearray(num_blocks)
        self.free_queue = FreeBlockQueue(num_blocks)
        # Per group: hash -> earliest cached block (in the shard of the hash's last byte,
        # see _SHARD_ENTRIES), and hash -> later duplicates in order.
        shards = shard_count(num_blocks) if index_shards is None else index_shards
        if not 1 <= shards <= _MAX_SHARDS or shards & (shards - 1):
            raise ValueError(
                f"index_shards must be a power of two up to {_MAX_SHARDS}, got {shards}"
            )
        self.shard_mask = shards - 1
        self._index: list[list[dict[BlockHash, int]]] = [
            [{} for _ in range(self.shard_mask + 1)] for _ in range(num_groups)
        ]
        self._dups: list[dict[BlockHash, list[int]]] = [{} for _ in range(num_groups)]

        self.num_reserved_blocks = 0
        self.num_cached_blocks = 0
        self.num_evictions = 0
        self.num_allocated_blocks = 0
        self.num_freed_blocks = 0

    # -- queries -------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null excluded) not in the free queue."""
        usable = self.num_blocks - 1
        if not usable:
            return 0.0
        return 1.0 - self.free_queue.num_free_blocks / usable

    def get_cached_block(self, block_hash: BlockHash, group_ids: Sequence[int]) -> list[int] | None:
        """The cached block of ``block_hash`` in each group, or None if any group misses."""
        found: list[int] = []
        shard = block_hash[-1] & self.shard_mask
        for group_id in group_ids:
            block_id = self._index[group_id][shard].get(block_hash)
            if block_id is None:
                return None
            found.append(block_id)
        return found

    def cached_index(self, group_id: int) -> dict[BlockHash, int]:
        """One group's hash -> earliest block map, as a new dict (a snapshot's copy)."""
        merged: dict[BlockHash, int] = {}
        for shard in self._index[group_id]:
            merged.update(shard)
        return merged

    def cached_shards(self, group_id: int) -> list[dict[BlockHash, int]]:
        """The live shards of one group's index (read-only use, for hot lookup loops): the
        block of ``h`` is ``shards[h[-1] & shard_mask].get(h)``."""
        return self._index[group_id]

    def cached_blocks_of(self, block_hash: BlockHash, group_id: int) -> list[int]:
        """Every block cached under ``block_hash`` in ``group_id``, earliest first."""
        first = self._index[group_id][block_hash[-1] & self.shard_mask].get(block_hash)
        if first is None:
            return []
        return [first, *self._dups[group_id].get(block_hash, ())]

    def num_index_entries(self) -> int:
        """Blocks in the prefix index, duplicates included."""
        return self.num_cached_blocks

    # -- allocation ----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with one holder.

        A taken block that was still cached loses its hash now (lazy eviction).

        Raises:
            ValueError: fewer free blocks than asked for (callers check first).
        """
        ids, first_linked = self.free_queue.popleft_n(num_blocks)
        ref = self.ref_cnt
        for block_id in ids:
            ref[block_id] = 1
        if first_linked < num_blocks:
            self._evict_hashes(ids[first_linked:])
        self.num_allocated_blocks += num_blocks
        return ids

    def get_new_block(self) -> int:
        """``get_new_blocks(1)[0]`` without the lists (a decode step's block-boundary case,
        which in a pool that has cycled takes a cached block: its hash goes here)."""
        free_queue = self.free_queue
        block_id = free_queue.popleft_fresh()
        if not block_id:
            block_id = free_queue.popleft_linked()
            if self.block_hash[block_id] is not None:
                self._evict_one(block_id)
        self.ref_cnt[block_id] = 1
        self.num_allocated_blocks += 1
        return block_id

    def reserve_blocks(self, num_blocks: int) -> list[int]:
        """Take blocks for the lifetime of the pool (e.g. attention-sink blocks)."""
        ids = self.get_new_blocks(num_blocks)
        self.num_reserved_blocks += num_blocks
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block; a free (cached) block leaves the free queue.

        Used when a request's prefix hits cached blocks.
        """
        ref = self.ref_cnt
        remove = self.free_queue.remove
        for block_id in block_ids:
            count = ref[block_id]
            if not count:
                remove(block_id)
            ref[block_id] = count + 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one holder of each block; blocks left without holders become free.

        Blocks that never got a hash go to the front of the free queue (nothing can hit
        them, so reuse them first); cached blocks go to the back in the given order, so
        callers pass a request's blocks tail first to make the tail evicted first.
        """
        ref = self.ref_cnt
        hashes = self.block_hash
        fresh: list[int] = []
        cached: list[int] = []
        for block_id in ordered_block_ids:
            count = ref[block_id] - 1
            ref[block_id] = count
            if not count:
                if hashes[block_id] is None:
                    fresh.append(block_id)
                else:
                    cached.append(block_id)
            else:
                assert count > 0, f"block {block_id} freed more often than held"
        if fresh:
            self.free_queue.prepend_n(fresh)
        if cached:
            self.free_queue.append_n(cached)
        self.num_freed_blocks += len(fresh) + len(cached)

    # -- the prefix index ----------------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[int],
        block_hashes: BlockHashList,
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int,
        block_size: int,
        token_ids: Sequence[int] = (),
        lora_name: str | None = None,
        block_mask: Sequence[bool] | None = None,
        extra_keys: BlockExtraKeys | None = None,
        lora_id: int | None = None,
    ) -> None:
        """Index ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        Null entries are skipped; blocks that already carry the hash (a prefix hit) are left
        as they are; so are blocks whose ``block_mask`` entry is False (blocks of a window
        group that no hit can use, under sparse retention).

        Args:
            blocks: the request's block table of this group.
            block_hashes: the request's hashes at this group's block size.
            num_cached_blocks: blocks of the table already processed.
            num_full_blocks: blocks that are full after this call.
            group_id: the group.
            block_size: the group's block size (events).
            token_ids: the request's tokens (events).
            lora_name: the request's adapter (events).
            lora_id: the adapter's integer id as the engine numbers it (events).
            block_mask: per block of ``blocks[num_cached_blocks:num_full_blocks]``,
                whether to cache it (None: all).
            extra_keys: the request's extra keys per block (events; None: it has none).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(block_hashes) >= num_full_blocks
        assert block_mask is None or len(block_mask) == num_full_blocks - num_cached_blocks
        hashes = self.block_hash
        if block_mask is not None and not all(block_mask):
            masked = list(blocks)
            for i, keep in enumerate(block_mask):
                if not keep:
                    masked[num_cached_blocks + i] = NULL_BLOCK_ID
            blocks = masked
        if num_full_blocks == num_cached_blocks + 1:
            # A decode step filling one block: the loop below, unrolled for one block.
            i = num_cached_blocks
            block_id = blocks[i]
            block_hash = block_hashes[i]
            if block_id == NULL_BLOCK_ID or hashes[block_id] is not None:
                assert block_id == NULL_BLOCK_ID or (
                    hashes[block_id] == block_hash and self.block_group[block_id] == group_id
                ), f"block {block_id} is cached under another hash: a wrong prefix hit"
                if self.events is not None:  # vLLM reports the step, without a hash
                    self._emit_stored(
                        [], block_hashes, group_id, block_size, token_ids, (lora_name, lora_id),
                        extra_keys, i, i + 1,
                    )  # fmt: skip
                return
            hashes[block_id] = block_hash
            self.block_group[block_id] = group_id
            shard = self._index[group_id][block_hash[-1] & self.shard_mask]
            if shard.setdefault(block_hash, block_id) != block_id:
                self._dups[group_id].setdefault(block_hash, []).append(block_id)
            self.num_cached_blocks += 1
            if self.events is not None:
                self._emit_stored(
                    [i], block_hashes, group_id, block_size, token_ids, (lora_name, lora_id),
                    extra_keys, i, i + 1,
                )  # fmt: skip
            return
        groups = self.block_group
        shards = self._index[group_id]
        mask = self.shard_mask
        stored: list[int] | None = [] if self.events is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block_id = blocks[i]
            if block_id == NULL_BLOCK_ID:
                continue
            block_hash = block_hashes[i]
            current = hashes[block_id]
            if current is not None:
                assert current == block_hash and groups[block_id] == group_id, (
                    f"block {block_id} is cached under another hash: a wrong prefix hit"
                )
                continue
            hashes[block_id] = block_hash
            groups[block_id] = group_id
            first = shards[block_hash[-1] & mask].setdefault(block_hash, block_id)
            if first != block_id:
                self._dups[group_id].setdefault(block_hash, []).append(block_id)
            self.num_cached_blocks += 1
            if stored is not None:
                stored.append(i)
        if stored is not None:
            self._emit_stored(
                stored, block_hashes, group_id, block_size, token_ids, (lora_name, lora_id),
                extra_keys, num_cached_blocks, num_full_blocks,
            )  # fmt: skip

    def _emit_stored(
        self,
        positions: list[int],
        block_hashes: BlockHashList,
        group_id: int,
        block_size: int,
        token_ids: Sequence[int],
        lora: tuple[str | None, int | None],
        extra_keys: BlockExtraKeys | None,
        start: int,
        end: int,
    ) -> None:
        """One event for one caching step of blocks ``[start, end)``, worded as vLLM 0.32's
        ``BlockPool.cache_full_blocks`` words it: the hashes of the blocks it cached
        (``positions``; blocks it skipped, null or out of a window's reach, have none, so
        there may be none at all), the parent of block ``start``, and the tokens of the
        whole range."""
        assert self.events is not None
        tokens = token_ids[start * block_size : end * block_size]
        self.events.pending.append(
            BlockStored(
                [block_hashes[i] for i in positions],
                block_hashes[start - 1] if start > 0 else None,
                tokens if isinstance(tokens, array) else array("I", tokens),
                block_size,
                lora[0],
                self.medium,
                group_id,
                self.group_kinds[group_id],
                _keys_of_blocks(extra_keys, positions, block_size),
                lora[1],
            )
        )

    def _evict_hashes(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hash of each block that has one (the block stays where it is)."""
        hashes = self.block_hash
        block_group = self.block_group
        # Runs of one group's hashes in eviction order (vLLM reports each evicted block in
        # the order it goes, groups interleaved; consecutive ones of a group share an event).
        removed: list[tuple[int, list[BlockHash]]] | None = [] if self.events is not None else None
        num_evicted = 0
        for block_id in block_ids:
            block_hash = hashes[block_id]
            if block_hash is None:
                continue
            group_id = block_group[block_id]
            self._unindex(block_id, block_hash, group_id)
            hashes[block_id] = None
            num_evicted += 1
            if removed is not None:
                if removed and removed[-1][0] == group_id:
                    removed[-1][1].append(block_hash)
                else:
                    removed.append((group_id, [block_hash]))
        self.num_cached_blocks -= num_evicted
        self.num_evictions += num_evicted
        if removed:
            assert self.events is not None
            for group_id, group_hashes in removed:
                self.events.append(
                    BlockRemoved(
                        block_hashes=group_hashes, medium=self.medium, group_index=group_id
                    )
                )

    def _evict_one(self, block_id: int) -> None:
        """``_evict_hashes([block_id])`` for a block known to carry a hash, without the
        runs it groups events into (one block is one event)."""
        block_hash = self.block_hash[block_id]
        assert block_hash is not None
        group_id = self.block_group[block_id]
        self._unindex(block_id, block_hash, group_id)
        self.block_hash[block_id] = None
        self.num_cached_blocks -= 1
        self.num_evictions += 1
        if self.events is not None:
            self.events.append(
                BlockRemoved(block_hashes=[block_hash], medium=self.medium, group_index=group_id)
            )

    def _unindex(self, block_id: int, block_hash: BlockHash, group_id: int) -> None:
        """Take ``block_id`` out of its group's prefix index under ``block_hash``: the
        earliest later duplicate takes over the hash where the block held it, as vLLM's
        index keeps the earliest block of a hash."""
        index = self._index[group_id][block_hash[-1] & self.shard_mask]
        dups = self._dups[group_id]
        if index.get(block_hash) == block_id:
            later = dups.get(block_hash)
            if later:
                index[block_hash] = later.pop(0)
                if not later:
                    del dups[block_hash]
            else:
                del index[block_hash]
        else:
            later = dups[block_hash]
            later.remove(block_id)
            if not later:
                del dups[block_hash]

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix index (e.g. their KV failed to load).

        Held blocks stay held and free blocks stay in the free queue; only the hash goes.
        """
        self._evict_hashes(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix index; refused (False) while any block is held.

        Returns:
            Whether the index was reset.
        """
        num_held = self.num_blocks - 1 - self.num_reserved_blocks - self.free_queue.num_free_blocks
        if num_held:
            return False
        self.clear_prefix_index()
        return True

    def clear_prefix_index(self) -> int:
        """Empty the prefix index even while blocks are held (their KV is gone).

        Held blocks stay held and free ones stay where they are in the free queue; only
        the hashes go, so no later request can hit a block. One ``AllBlocksCleared``
        event says so. Evictions are not counted: nothing was reused.

        Returns:
            The number of blocks that lost their hash.
        """
        dropped = self.num_cached_blocks
        # In place: managers keep references to these containers for their hot loops.
        for shards in self._index:
            for shard in shards:
                shard.clear()
        for dups in self._dups:
            dups.clear()
        self.block_hash[:] = [None] * self.num_blocks
        self.num_cached_blocks = 0
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return dropped

    # -- state (persistence) -----------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything that decides this pool's future behaviour, as plain values.

        The prefix index is not written out as such: each cached block carries its hash
        and group, which gives the index, except which of several blocks cached under one
        hash is the one a lookup returns and the order of the others; ``dups`` keeps
        exactly that (``[hash, first, later...]`` per duplicated hash, per group).
        Pending events must have been drained (the server drains after every call).

        Raises:
            ValueError: events are pending.
        """
        if self.events is not None and self.events.pending:
            raise ValueError("the block pool has undrained events; take them first")
        mask = self.shard_mask
        dups = [
            [[h, shards[h[-1] & mask][h], *later] for h, later in group_dups.items()]
            for shards, group_dups in zip(self._index, self._dups, strict=True)
        ]
        return {
            "num_blocks": self.num_blocks,
            "num_groups": self.num_groups,
            "enable_caching": self.enable_caching,
            "ref_cnt": list(self.ref_cnt),
            "block_hash": list(self.block_hash),
            "block_group": bytes(self.block_group),
            "dups": dups,
            "free_queue": self.free_queue.to_state(),
            "num_reserved_blocks": self.num_reserved_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "num_evictions": self.num_evictions,
            "num_allocated_blocks": self.num_allocated_blocks,
            "num_freed_blocks": self.num_freed_blocks,
            "event_seq": self.events.last_seq if self.events is not None else 0,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over ``state`` (from :meth:`to_state` of a pool of the same shape).

        Containers are updated in place: managers hold references to them.

        Raises:
            ValueError: a state of another shape, or one whose index does not add up.
        """
        n = self.num_blocks
        for key, mine in (
            ("num_blocks", n),
            ("num_groups", self.num_groups),
            ("enable_caching", self.enable_caching),
        ):
            if state[key] != mine:
                raise ValueError(f"block pool state has {key}={state[key]!r}, this pool {mine!r}")
        ref_cnt, block_hash = state["ref_cnt"], state["block_hash"]
        block_group = state["block_group"]
        if len(ref_cnt) != n or len(block_hash) != n or len(block_group) != n:
            raise ValueError("block pool state arrays have the wrong length")
        # The null block's count drifts around its large constant (nulls in freed tables
        # are decremented, null hits touched) but never comes near 0.
        if ref_cnt[NULL_BLOCK_ID] < _NULL_REF_COUNT // 2 or block_hash[NULL_BLOCK_ID] is not None:
            raise ValueError("block pool state: the null block is not the null block")
        dup_blocks: list[dict[BlockHash, list[int]]] = [{} for _ in range(self.num_groups)]
        for group_id, entries in enumerate(state["dups"]):
            for h, first, *later in entries:
                dup_blocks[group_id][h] = [first, *later]
        # Cached blocks by group, in id order (hashes are non-empty bytes: compress keeps
        # exactly the cached ones, at C speed; a million-block pool loads in milliseconds).
        cached_ids = list(compress(range(n), block_hash))
        if self.num_groups == 1:
            by_group = [cached_ids]
        else:
            by_group = [[] for _ in range(self.num_groups)]
            for block_id in cached_ids:
                group_id = block_group[block_id]
                if group_id >= self.num_groups:
                    raise ValueError(
                        f"block {block_id} is cached in group {group_id}: no such group"
                    )
                by_group[group_id].append(block_id)
        indexes: list[dict[BlockHash, int]] = []
        for group_id, ids in enumerate(by_group):
            hashes = list(map(block_hash.__getitem__, ids))
            dups = dup_blocks[group_id]
            if dups:
                index = {h: b for h, b in zip(hashes, ids, strict=True) if h not in dups}
                listed = 0
                for h, blocks in dups.items():
                    if len(set(blocks)) != len(blocks) or any(
                        block_hash[b] != h or block_group[b] != group_id for b in blocks
                    ):
                        raise ValueError("block pool state: a duplicate entry does not match")
                    index[h] = blocks[0]
                    listed += len(blocks)
                # Every cached block is the one entry of its hash, or listed with its copies.
                complete = len(index) - len(dups) + listed == len(ids)
            else:
                index = dict(zip(hashes, ids, strict=True))
                complete = len(index) == len(ids)
            if not complete:
                raise ValueError(
                    f"block pool state: group {group_id} caches a hash on several blocks "
                    "without saying which is found first"
                )
            indexes.append(index)
        if len(cached_ids) != state["num_cached_blocks"]:
            raise ValueError(
                f"block pool state counts {state['num_cached_blocks']} cached blocks, "
                f"its hashes {len(cached_ids)}"
            )
        self.free_queue.load_state(state["free_queue"])
        self.ref_cnt[:] = list(ref_cnt)
        self.block_hash[:] = list(block_hash)
        self.block_group[:] = bytes(block_group)
        mask = self.shard_mask
        for group_id in range(self.num_groups):
            shards = self._index[group_id]
            for shard in shards:
                shard.clear()
            if mask:
                for h, block_id in indexes[group_id].items():
                    shards[h[-1] & mask][h] = block_id
            else:
                shards[0].update(indexes[group_id])
            self._dups[group_id].clear()
            self._dups[group_id].update(
                {h: blocks[1:] for h, blocks in dup_blocks[group_id].items()}
            )
        self.num_reserved_blocks = state["num_reserved_blocks"]
        self.num_cached_blocks = len(cached_ids)
        self.num_evictions = state["num_evictions"]
        self.num_allocated_blocks = state["num_allocated_blocks"]
        self.num_freed_blocks = state["num_freed_blocks"]
        if self.events is not None:
            self.events.pending.clear()
            self.events.restore(state["event_seq"])
