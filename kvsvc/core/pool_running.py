"""The loop behind ``PoolKVCache.allocate_running``: a batch of running requests' steps.

A Step's decode run is a few hundred one-token allocations of running requests. This loop
applies them with ``allocate``'s exact semantics, inlining what ``allocate``, the manager
and the full-attention manager would do for one plain group (append, hash a completed
block, take a block at a boundary, cache what is full), and falls back on ``allocate`` for
anything else. It is the facade's own code, kept apart because it is the hot path: it
reads and writes the facade's request bookkeeping as the facade's methods do.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import cast

import xxhash

from kvsvc.core.hashing import MAX_TOKEN_ID_EXCLUSIVE, validate_token_ids
from kvsvc.core.pool_base import PoolKVCacheBase
from kvsvc.core.pool_limits import too_many_tokens, too_many_unscheduled
from kvsvc.core.pool_types import AllocateOutcome, RunningColumns
from kvsvc.errors import InvalidArgument, KvsvcError, quoted

# The loop's bound where a pool sets none: past any count of tokens a pool can hold, and
# a small int when compiled (sys.maxsize is not: every comparison with it took the
# boxed-integer path, ~5% of a decode Step's loop).
_UNBOUNDED = 1 << 60


def _token_error(token: object) -> InvalidArgument:
    """The error ``allocate`` raises for this bad token id (same words on both paths)."""
    try:
        validate_token_ids((token,), "new_token_ids")  # type: ignore[arg-type]
    except InvalidArgument as exc:
        return exc
    raise AssertionError(f"{token!r} passed validation")


class RunningBatchPool(PoolKVCacheBase):
    """The running-batch loop of :class:`~kvsvc.core.pool.PoolKVCache`, which inherits it:
    a class of its own so that the hot path reads apart from the facade's other calls,
    with its fields' accesses native in the compiled core."""

    def allocate_running(
        self,
        request_ids: list[str],
        token_ids: Sequence[int],
        token_counts: list[int],
        num_new_tokens: list[int],
        begin: int,
        end: int,
        token_pos: int,
        out: RunningColumns,
        num_in_flight_tokens: list[int] | None = None,
    ) -> int:
        """``allocate`` for operations ``begin..end`` of a batch of running requests.

        The engine's decode step is a few hundred calls like ``allocate(rid, [token], 1)``;
        made one by one they cost more in call overhead than in work. This applies them in
        order with the same semantics as ``allocate(rid, tokens, n)`` (each atomic, an
        invalid one rejected alone) and writes their results into ``out``'s columns instead
        of building an outcome object per call: operation ``i``'s at index ``i`` of
        columns made for the whole Step (``RunningColumns(n)``), an item set in place
        where an append was a call into the list's growth code (three a decode).
        Operation ``i`` owns ``token_counts[i]`` ids of ``token_ids``, starting at
        ``token_pos`` for ``begin``. Its
        ``num_in_flight_tokens`` (None: all 0) change nothing in a full-attention pool (no
        window frees blocks) but are checked as ``allocate`` checks them.

        The per-operation columns are lists (as the Step's decoder makes them), not any
        sequence: compiled, a list's item is read in place, where a sequence's goes through
        the generic protocol with a boxed index (a tenth of this loop's time for 256
        operations).

        Only for pools where :attr:`has_plain_tables` (one full-attention group: no null
        blocks to report); operations with more than one token take the general path.

        Returns:
            The token position after operation ``end - 1``.
        """
        requests = self._requests
        manager = self.manager
        plain = manager._plain_group
        max_model_len = self.max_model_len
        ok_out = out.ok
        computed_out = out.num_computed_tokens
        blocks_out = out.new_block_ids
        errors = out.errors
        empty = out.EMPTY
        admissions = self._admissions
        if plain is None:
            raise TypeError("allocate_running needs a pool with one full-attention group")
        tables = plain.req_to_blocks
        cached_counts = plain.num_cached_block
        block_size = plain.block_size
        pool = manager.block_pool
        free_queue = pool.free_queue
        caching = manager.enable_caching
        hasher = manager.hasher
        hash_block_size = hasher.block_size if hasher is not None else 0
        same_hash_size = hash_block_size == block_size
        # xxh3 hashes the ids' little-endian int32 bytes: an array's own bytes here.
        plain_xxh3 = hasher is not None and hasher.algo == "xxh3_128" and sys.byteorder == "little"
        none_hash = hasher.none_hash if hasher is not None else b""
        xxh3_digest = xxhash.xxh3_128_digest
        group_id = plain.group_id
        flagged = self._recompute
        # Tokens held, kept in a local across the loop (written back around the general
        # path, which counts its own, and at the end).
        held = self.num_tokens_held
        max_held = self.max_tokens if self.max_tokens is not None else _UNBOUNDED
        unscheduled_sum = self.num_tokens_unscheduled
        max_unscheduled = (
            self.max_unscheduled_tokens if self.max_unscheduled_tokens is not None else _UNBOUNDED
        )
        pos = token_pos
        # The run's token ids as a list of objects, read at ``pos - token_pos``: compiled,
        # a list's item is read in place, where the packed array('I') a client sends is
        # read through the generic item protocol with a boxed index (~190 instructions a
        # read; one list made by the array's own loop costs a tenth of that an item). As
        # objects: compiled, a declared int would fail before the check below.
        unchecked_ids: list[object]
        if type(token_ids) is list:
            unchecked_ids = cast(list[object], token_ids)
            token_base = 0
        else:
            token_stop = token_pos
            for i in range(begin, end):
                token_stop += token_counts[i]
            if type(token_ids) is array.array:
                packed = cast("array.array[int]", token_ids)
                unchecked_ids = cast(list[object], packed[token_pos:token_stop].tolist())
            else:
                unchecked_ids = list(token_ids[token_pos:token_stop])
            token_base = token_pos
        # array.array's append, called as a function: a method call on the token array
        # looks ``append`` up on its type each time (~170 instructions a decode).
        array_type = array.array
        append_to_array = array.array.append
        in_flight_of = num_in_flight_tokens
        for i in range(begin, end):
            count = token_counts[i]
            num_new = num_new_tokens[i]
            request_id = request_ids[i]
            request = requests.get(request_id)
            in_flight = in_flight_of[i] if in_flight_of is not None else 0
            if (
                count > 1
                or request is None
                or num_new < 0
                or (flagged and request_id in flagged)
                or (in_flight and not 0 <= in_flight <= request.num_computed_tokens)
            ):
                # General path: error reporting, multi-token appends.
                tokens = token_ids[pos : pos + count]
                pos += count
                self.num_tokens_held = held
                self.num_tokens_unscheduled = unscheduled_sum
                failure: KvsvcError | None = None
                try:
                    outcome = self._allocate_general(request_id, tokens, num_new, in_flight)
                except KvsvcError as exc:
                    failure = exc
                # The general path counts its own tokens: take its totals back.
                held = self.num_tokens_held
                unscheduled_sum = self.num_tokens_unscheduled
                if failure is not None:
                    errors[i] = failure
                    ok_out[i] = False
                    computed_out[i] = 0
                    blocks_out[i] = empty
                    continue
                if outcome.recompute:
                    out.recompute.append(i)
                ok_out[i] = outcome.ok
                computed_out[i] = outcome.num_computed_tokens
                blocks_out[i] = outcome.new_block_ids[0] or empty
                continue
            # One full-attention group, a running request, at most one new token.
            tokens_list = request.all_token_ids
            num_tokens_before = len(tokens_list)
            if count:
                token = unchecked_ids[pos - token_base]
                pos += 1
                if type(token) is not int or not 0 <= token < MAX_TOKEN_ID_EXCLUSIVE:
                    errors[i] = _token_error(token)
                    ok_out[i] = False
                    computed_out[i] = 0
                    blocks_out[i] = empty
                    continue
                if num_tokens_before + 1 > max_model_len:
                    errors[i] = InvalidArgument(
                        "new_token_ids",
                        f"request {quoted(request_id)} would reach {num_tokens_before + 1} tokens, "
                        f"past max_model_len={max_model_len}",
                    )
                    ok_out[i] = False
                    computed_out[i] = 0
                    blocks_out[i] = empty
                    continue
                if held >= max_held:
                    self.num_tokens_held = held
                    errors[i] = too_many_tokens(self, request_id, 1)
                    ok_out[i] = False
                    computed_out[i] = 0
                    blocks_out[i] = empty
                    continue
            computed = request.num_computed_tokens
            num_main = computed + num_new
            if num_main > max_model_len:
                errors[i] = InvalidArgument(
                    "num_new_tokens",
                    f"{computed} computed + {num_new} new tokens exceed "
                    f"max_model_len={max_model_len}",
                )
                ok_out[i] = False
                computed_out[i] = 0
                blocks_out[i] = empty
                continue
            unscheduled_before = num_tokens_before - computed
            unscheduled_after = num_tokens_before + count - num_main
            unscheduled_delta = (unscheduled_after if unscheduled_after > 0 else 0) - (
                unscheduled_before if unscheduled_before > 0 else 0
            )
            if unscheduled_delta > 0 and unscheduled_sum + unscheduled_delta > max_unscheduled:
                self.num_tokens_unscheduled = unscheduled_sum
                errors[i] = too_many_unscheduled(self, request_id, unscheduled_delta)
                ok_out[i] = False
                computed_out[i] = 0
                blocks_out[i] = empty
                continue
            table = tables[request_id]
            needed = -(-num_main // block_size) - len(table)
            if needed > 0 and needed > free_queue.num_free_blocks:
                # NO_SPACE: nothing was changed yet.
                ok_out[i] = False
                computed_out[i] = computed
                blocks_out[i] = empty
                continue
            # The request's length after this operation (len() per use cost ~5% of a Step).
            num_tokens = num_tokens_before + 1 if count else num_tokens_before
            if count:
                if type(tokens_list) is array_type:
                    append_to_array(tokens_list, token)  # an int, checked above
                else:
                    tokens_list.append(cast(int, token))
                held += 1
                if hasher is not None:
                    block_hashes = request.block_hashes
                    if num_tokens >= (len(block_hashes) + 1) * hash_block_size:
                        if (
                            plain_xxh3
                            and request.extra_keys is None
                            and num_tokens == (len(block_hashes) + 1) * hash_block_size
                            and type(tokens_list) is array.array
                        ):
                            # The token completed exactly one block: hash just it (the
                            # hasher's xxh3 path, for one block without extra keys).
                            block_hashes.append(
                                xxh3_digest(
                                    (block_hashes[-1] if block_hashes else none_hash)
                                    + tokens_list[num_tokens - hash_block_size :].tobytes()
                                )
                            )
                        else:
                            request.update_block_hashes()
            if needed == 1:
                block_id = pool.get_new_block()
                table.append(block_id)
                new_blocks = [block_id]
            elif needed > 0:
                new_blocks = pool.get_new_blocks(needed)
                table.extend(new_blocks)
            else:
                new_blocks = empty
            if caching:
                num_to_cache = num_main if num_main < num_tokens else num_tokens
                num_full = num_to_cache // block_size
                num_cached = cached_counts[request_id]
                if num_full > num_cached:
                    if same_hash_size:
                        # The manager's cache_blocks, minus its layers (one group, hashes
                        # already at the block size).
                        pool.cache_full_blocks(
                            table,
                            request.block_hashes,
                            num_cached,
                            num_full,
                            group_id,
                            block_size,
                            tokens_list,
                            request.lora_name,
                            extra_keys=request.extra_keys,
                            lora_id=request.lora_id,
                        )
                        cached_counts[request_id] = num_full
                    else:
                        plain.cache_blocks(request, num_to_cache)
            request.num_computed_tokens = num_main
            unscheduled_sum += unscheduled_delta
            if admissions:
                admissions.pop(request_id, None)  # as in allocate: no retry after this
            ok_out[i] = True
            computed_out[i] = num_main
            blocks_out[i] = new_blocks
        self.num_tokens_held = held
        self.num_tokens_unscheduled = unscheduled_sum
        return pos

    def _allocate_general(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_in_flight_tokens: int = 0,
    ) -> AllocateOutcome:
        """``allocate(request_id, token_ids, num_new_tokens, num_in_flight_tokens=...)``:
        the general path, for an operation this loop does not take itself (the facade
        overrides it)."""
        raise NotImplementedError("PoolKVCache.allocate")
