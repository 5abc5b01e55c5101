"""Per-request bookkeeping the scheduler keeps in-process: tokens, progress, block hashes."""

from __future__ import annotations

import array
from collections.abc import MutableSequence, Sequence
from typing import Any

from kvsvc.core.hashing import BlockExtraKeys, BlockHash, BlockHasher, HashingContext


class RequestState:
    """One request as the KV cache manager sees it.

    Holds what vLLM's ``Request`` gives its KV cache manager: every token known so far
    (prompt, then sampled outputs), how many of them the engine has computed, and the chained
    hashes of the full ``hash_block_size`` blocks, updated incrementally as tokens arrive (a
    decode step hashes only a block it completes).

    Args:
        request_id: the engine's id.
        token_ids: the prompt (or, on resumption, prompt plus outputs so far): a list, or
            the wire's ``array('I')``. Taken over, not copied.
        hasher: the pool's hasher; None when prefix caching is off (no hashes kept).
        hashing: extra-key context (LoRA, salt, multimodal items, prompt embeds).
        skip_reading_prefix_cache: never read the cache for this request (it still writes).
        resumed: re-admission after preemption (counted apart in prefix-cache stats).
        num_encoder_tokens: encoder input length (cross-attention models).
        packed_token_ids: ``pack_token_ids(token_ids)`` if the caller validated with it
            already (spares re-packing the prompt for ``xxh3_128``).
    """

    __slots__ = (
        "_hasher",
        "all_token_ids",
        "block_hashes",
        "extra_keys",
        "hashing",
        "lora_id",
        "lora_name",
        "num_computed_tokens",
        "num_encoder_tokens",
        "num_prompt_tokens",
        "request_id",
        "resumed",
        "shared_prefix_boundary",
        "skip_reading_prefix_cache",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: MutableSequence[int],
        *,
        hasher: BlockHasher | None = None,
        hashing: HashingContext | None = None,
        skip_reading_prefix_cache: bool = False,
        resumed: bool = False,
        num_encoder_tokens: int = 0,
        packed_token_ids: bytes | None = None,
        block_hashes: list[BlockHash] | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        # Where the admission's lookup found a longer hit in some group than in all of
        # them (a shared prefix a window group has not cached yet): sparse window
        # retention keeps the blocks ending there (vLLM's ``shared_prefix_boundary``).
        self.shared_prefix_boundary = 0
        self.block_hashes: list[BlockHash] = [] if block_hashes is None else block_hashes
        self.hashing = hashing
        self.lora_name = hashing.lora_name if hashing is not None else None
        self.lora_id = hashing.lora_id if hashing is not None else None
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.resumed = resumed
        self.num_encoder_tokens = num_encoder_tokens
        self._hasher = hasher
        self.extra_keys: BlockExtraKeys | None = None
        if hasher is not None and hashing is not None and not hashing.is_empty:
            self.extra_keys = BlockExtraKeys(hashing, hasher.block_size)
        if block_hashes is None:
            self.update_block_hashes(packed_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token_ids(self, token_ids: Sequence[int]) -> None:
        """Add sampled tokens and hash any block they complete."""
        tokens = self.all_token_ids
        tokens.extend(token_ids)
        hasher = self._hasher
        # Most decode steps complete no block: test before calling out.
        if hasher is not None and len(tokens) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.update_block_hashes()

    def update_block_hashes(self, packed_token_ids: bytes | None = None) -> None:
        """Hash the full blocks not hashed yet (none when caching is off)."""
        hasher = self._hasher
        if hasher is None:
            return
        hashes = self.block_hashes
        num_hashed = len(hashes)
        num_full = len(self.all_token_ids) // hasher.block_size
        if num_full > num_hashed:
            hashes.extend(
                hasher.hash_blocks(
                    self.all_token_ids,
                    num_hashed,
                    num_full - num_hashed,
                    hashes[-1] if num_hashed else None,
                    self.extra_keys,
                    packed_token_ids,
                )
            )

    def truncate(self, num_tokens: int) -> None:
        """Forget tokens past ``num_tokens`` and the hashes of blocks they completed.

        Undoes an ``append_token_ids`` whose allocation was refused.
        """
        del self.all_token_ids[num_tokens:]
        if self._hasher is not None:
            del self.block_hashes[num_tokens // self._hasher.block_size :]

    def to_state(self) -> list[Any]:
        """``[id, tokens, num_prompt_tokens, num_computed_tokens, block_hashes, hashing,
        skip_reading_prefix_cache, resumed, num_encoder_tokens]`` as plain values (the
        tokens as an ``array('I')`` whatever sequence holds them here; the pool keeps
        ``shared_prefix_boundary`` beside it)."""
        tokens = self.all_token_ids
        return [
            self.request_id,
            array.array("I", tokens),
            self.num_prompt_tokens,
            self.num_computed_tokens,
            list(self.block_hashes),
            None if self.hashing is None else self.hashing.to_state(),
            self.skip_reading_prefix_cache,
            self.resumed,
            self.num_encoder_tokens,
        ]

    @classmethod
    def from_state(cls, state: list[Any], hasher: BlockHasher | None) -> RequestState:
        """The request :meth:`to_state` describes, with its saved hashes (not re-hashed).

        Raises:
            ValueError: hashes that do not match the token count (a state of another
                hash block size, or a damaged one).
        """
        (
            request_id,
            tokens,
            num_prompt_tokens,
            num_computed_tokens,
            block_hashes,
            hashing,
            skip,
            resumed,
            num_encoder_tokens,
        ) = state
        # Saved hashes, not hashed again (a native class has no cls.__new__ to skip __init__).
        self = cls(
            request_id,
            # The wire's own token type (see unpack_token_ids); the fast paths expect it.
            array.array("I", tokens),
            hasher=hasher,
            hashing=None if hashing is None else HashingContext.from_state(hashing),
            skip_reading_prefix_cache=skip,
            resumed=resumed,
            num_encoder_tokens=num_encoder_tokens,
            block_hashes=list(block_hashes),
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = num_computed_tokens
        expected = 0 if hasher is None else len(self.all_token_ids) // hasher.block_size
        if len(self.block_hashes) != expected:
            raise ValueError(
                f"request {request_id!r}: {len(self.block_hashes)} saved block hashes for "
                f"{len(self.all_token_ids)} tokens ({expected} expected)"
            )
        return self

    def __repr__(self) -> str:
        return (
            f"RequestState({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


def num_unscheduled_tokens(request: RequestState) -> int:
    """A request's tokens not computed yet (0 when speculative ones run ahead)."""
    unscheduled = request.num_tokens - request.num_computed_tokens
    return unscheduled if unscheduled > 0 else 0
