"""Prompt hashing for the cluster scorer, with the servers' own core code.

The scorer must compute exactly the block hashes the servers index, so it goes through
:class:`kvsvc.core.hashing.BlockHasher` with the cluster's shared algorithm and seed, and
reads a coarser group's hashes the way the core does (every k-th hash block).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsvc.core.hashing import (
    HASH_ALGOS,
    BlockExtraKeys,
    BlockHasher,
    HashingContext,
    check_hashing_context,
    pack_token_ids,
)
from kvsvc.core.seed import seed_fingerprint
from kvsvc.errors import InvalidArgument


class PromptHasher:
    """Block hashes of prompts as the servers of one cluster compute them.

    Args:
        algo: the cluster's ``hash_algo``.
        seed: the cluster's seed; None only for ``sha256_cbor`` (its fixed public seed):
            an ``xxh3_128`` server without a given seed has a random secret nobody else
            can reproduce, so scoring it needs the seed it was given.

    Raises:
        InvalidArgument: an unknown algorithm, or ``xxh3_128`` without a seed.
    """

    def __init__(self, algo: str, seed: str | None) -> None:
        if algo not in HASH_ALGOS:
            raise InvalidArgument("hash_algo", f"unknown {algo!r}; valid: {', '.join(HASH_ALGOS)}")
        if seed is None and algo != "sha256_cbor":
            raise InvalidArgument(
                "hash_seed",
                f"{algo} hashes need the cluster's seed (the servers' --hash-seed-file); "
                "without one every server has a random secret seed",
            )
        self.algo = algo
        self.seed = seed
        self._hashers: dict[int, BlockHasher] = {}
        self.fingerprint = seed_fingerprint(self._hasher(16).seed)

    def _hasher(self, hash_block_size: int) -> BlockHasher:
        hasher = self._hashers.get(hash_block_size)
        if hasher is None:
            hasher = self._hashers[hash_block_size] = BlockHasher(
                self.algo, hash_block_size, self.seed
            )
        return hasher

    def block_hashes(
        self,
        token_ids: Sequence[int],
        hash_block_size: int,
        block_size: int,
        hashing: HashingContext | None = None,
    ) -> list[bytes]:
        """The hashes a group of ``block_size`` indexes for the prompt's full blocks.

        Raises:
            InvalidArgument: a token id outside [0, 2^31), multimodal items outside the
                prompt, or a block size that is not a multiple of the hash block size.
        """
        if hash_block_size < 1 or block_size % hash_block_size:
            raise InvalidArgument(
                "block_size",
                f"{block_size} is not a multiple of the hash block size {hash_block_size}",
            )
        packed = pack_token_ids(token_ids, "token_ids")
        check_hashing_context(hashing, len(token_ids))
        hasher = self._hasher(hash_block_size)
        extra = (
            BlockExtraKeys(hashing, hash_block_size)
            if hashing is not None and not hashing.is_empty
            else None
        )
        hashes = hasher.hash_blocks(
            token_ids, 0, len(token_ids) // hash_block_size, None, extra, packed
        )
        step = block_size // hash_block_size
        return hashes[step - 1 :: step] if step > 1 else hashes
