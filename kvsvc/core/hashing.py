"""Block hashes: one chained fingerprint per full block of ``hash_block_size`` tokens.

The hash of block ``i`` covers the whole prefix ending at that block::

    hash(i) = H(parent = hash(i - 1) or NONE_HASH,  tokens of block i,  extra keys of block i)

so two requests share a cached block only when everything before it is equal too. The first
block's parent ``NONE_HASH`` is derived from a seed: fixed and shareable for the cryptographic
``sha256_cbor`` (``"vllm-none-hash"``, as vLLM), random and secret for the fast ``xxh3_128`` (a
predictable seed would let anyone precompute colliding prompts). A service that persists its
prefix index must persist the seed with it (:attr:`BlockHasher.seed`).

Algorithms:

``sha256_cbor``
    ``sha256(cbor2.dumps((parent, tuple(tokens), extra_keys or None), canonical=True))`` and
    ``NONE_HASH = sha256(cbor2.dumps(seed, canonical=True))`` — byte-identical to vLLM's
    ``sha256_cbor`` block hashes for the same tokens, extra keys and seed. Instead of one
    ``cbor2.dumps`` per block, cbor2 encodes all new tokens at once and each block's bytes
    are sliced out of that: CBOR integers have one shortest form, so the bytes are the same
    (the golden tests derive the digests with hashlib + cbor2 directly).
``xxh3_128`` (default)
    ``xxh3_128(parent + tokens as little-endian int32 + cbor(extra_keys) if any)``. Not
    vLLM-compatible; several times faster. Parent and token bytes have fixed lengths, so the
    concatenation is unambiguous.

Extra keys follow the reference's ``generate_block_hash_extra_keys``, in this order:
``("lora", name, path)``, one ``("mm", identifier, offset_in_block)`` per multimodal item the
block overlaps (the offset is negative when the item began in an earlier block),
``("cache_salt", salt)`` on the first block only, and ``("prompt_embeds", digest)`` for blocks
that have a prompt-embeddings digest.
"""

from __future__ import annotations

import array
import hashlib
import os
import struct
import sys
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Any, overload

import cbor2
import xxhash

from kvsvc.errors import InvalidArgument

HASH_ALGOS: tuple[str, ...] = ("xxh3_128", "sha256_cbor")
DEFAULT_SHA256_CBOR_SEED = "vllm-none-hash"
# Token ids are below 2^31: they fit the wire's uint32 fields and packed 32-bit form, and
# the xxh3 byte encoding packs them as int32.
MAX_TOKEN_ID_EXCLUSIVE = 2**31

BlockHash = bytes
ExtraKeys = tuple[tuple[Any, ...], ...]
# Bounds on a prompt's multimodal items (see check_hashing_context): far above what a model
# takes (vLLM caps items per prompt in the tens), low enough that a hostile context
# cannot make every block's extra-key walk or the request's memory large.
MAX_MM_ITEMS = 4096
MAX_MM_IDENTIFIER_BYTES = 256
# Every other string of a hashing context is bounded in bytes too: each is kept with the
# request and hashed into its blocks' extra keys, and lora_name is copied into every
# stored block's event (a 1 MiB name made one Step's event batch 314 MB). The same bound as
# a multimodal identifier (a digest, a name or a salt needs far less); a LoRA path is a
# file system path (PATH_MAX).
MAX_HASHING_STRING_BYTES = MAX_MM_IDENTIFIER_BYTES
MAX_LORA_PATH_BYTES = 4096


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input inside the prompt: its content hash and its placeholder tokens.

    Attributes:
        identifier: hash of the item's content (the engine's ``mm_hash``).
        offset: index of the item's first placeholder token in the prompt.
        length: number of placeholder tokens.
    """

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HashingContext:
    """What besides the token ids decides whether two prompts may share cached blocks.

    Attributes:
        cache_salt: isolates tenants: mixed into the first block only, which suffices
            because every later hash chains over it.
        lora_name: adapter name; requests of different adapters never share blocks.
        lora_path: adapter path, so re-pointing a name at new weights does not reuse KV.
        mm_items: multimodal items, any order (sorted by offset here).
        prompt_embeds_digests: one digest per ``hash_block_size`` block of prompt embeddings;
            blocks past the last digest get no prompt-embeds key.
        lora_id: the adapter's integer id as the engine numbers it (vLLM's
            ``lora_int_id``): reported in KV events as vLLM reports it, never hashed
            (the name and path key the blocks; the id is the engine's local handle).
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    prompt_embeds_digests: tuple[bytes, ...] = ()
    lora_id: int | None = None

    @property
    def is_empty(self) -> bool:
        return not (
            self.cache_salt or self.lora_name or self.mm_items or self.prompt_embeds_digests
        )

    def to_state(self) -> list[Any]:
        """Plain values that :meth:`from_state` turns back into an equal context."""
        return [
            self.cache_salt,
            self.lora_name,
            self.lora_path,
            [[item.identifier, item.offset, item.length] for item in self.mm_items],
            list(self.prompt_embeds_digests),
            self.lora_id,
        ]

    @classmethod
    def from_state(cls, state: list[Any]) -> HashingContext:
        # States written before lora_id existed have five entries.
        cache_salt, lora_name, lora_path, items, digests = state[:5]
        return cls(
            cache_salt=cache_salt,
            lora_name=lora_name,
            lora_path=lora_path,
            mm_items=tuple(MultiModalItem(i, o, n) for i, o, n in items),
            prompt_embeds_digests=tuple(digests),
            lora_id=state[5] if len(state) > 5 else None,
        )


def _check_bytes(value: str | bytes, bound: int, field: str) -> None:
    """``value`` is at most ``bound`` bytes (UTF-8 for a string)."""
    # At most 4 bytes a character: short strings need no encoding to be known in bounds.
    if len(value) <= bound // 4:
        return
    if isinstance(value, str):
        if len(value.encode()) > bound:
            raise InvalidArgument(field, f"longer than {bound} bytes (UTF-8)")
    elif len(value) > bound:
        raise InvalidArgument(field, f"longer than {bound} bytes")


def check_hashing_strings(context: HashingContext | None, field: str = "hashing") -> None:
    """Bound the strings of a hashing context in bytes: ``cache_salt``, ``lora_name`` and
    each prompt-embeds digest at :data:`MAX_HASHING_STRING_BYTES`, ``lora_path`` at
    :data:`MAX_LORA_PATH_BYTES` (multimodal identifiers: :func:`check_hashing_context`).

    Raises:
        InvalidArgument: naming the field (``<field>.lora_name``, ...) and the bound.
    """
    if context is None:
        return
    for name, bound in (
        ("cache_salt", MAX_HASHING_STRING_BYTES),
        ("lora_name", MAX_HASHING_STRING_BYTES),
        ("lora_path", MAX_LORA_PATH_BYTES),
    ):
        value = getattr(context, name)
        if value:
            _check_bytes(value, bound, f"{field}.{name}")
    for i, digest in enumerate(context.prompt_embeds_digests):
        _check_bytes(digest, MAX_HASHING_STRING_BYTES, f"{field}.prompt_embeds_digests[{i}]")


def check_hashing_context(
    context: HashingContext | None, num_tokens: int, field: str = "hashing"
) -> None:
    """Check a prompt's hashing context before anything is admitted or looked up: its
    strings' bounds (:func:`check_hashing_strings`) and its multimodal items.

    An item stands for placeholder tokens of the prompt, so it must lie inside it
    (``offset + length <= num_tokens``): one that does not would key blocks the prompt
    does not have (and a length of 10^9 is nothing a model produces). The count and the
    identifier bytes are bounded (:data:`MAX_MM_ITEMS`, :data:`MAX_MM_IDENTIFIER_BYTES`)
    because every block's extra keys are drawn from them.

    Args:
        context: the request's hashing context (None: nothing to check).
        num_tokens: the prompt's length (with the outputs so far on resumption).
        field: the context's name in error messages.

    Raises:
        InvalidArgument: naming the item (``<field>.mm_items[i]``) and the bound.
    """
    if context is None:
        return
    check_hashing_strings(context, field)
    if not context.mm_items:
        return
    items = context.mm_items
    if len(items) > MAX_MM_ITEMS:
        raise InvalidArgument(
            f"{field}.mm_items", f"{len(items)} items exceed the limit of {MAX_MM_ITEMS}"
        )
    for i, item in enumerate(items):
        where = f"{field}.mm_items[{i}]"
        # As objects: compiled, a declared str/int would fail before the check.
        identifier: object = item.identifier
        if not isinstance(identifier, str) or not identifier:
            raise InvalidArgument(f"{where}.identifier", "must be a non-empty string")
        _check_bytes(identifier, MAX_MM_IDENTIFIER_BYTES, f"{where}.identifier")
        offset: object = item.offset
        length: object = item.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length <= 0:
            raise InvalidArgument(
                where, f"needs offset >= 0 and length > 0, got offset={offset!r} length={length!r}"
            )
        if offset + length > num_tokens:
            raise InvalidArgument(
                where,
                f"offset {offset} + length {length} runs past the prompt's {num_tokens} "
                "tokens; an item must lie inside the prompt",
            )


class BlockExtraKeys:
    """The extra keys of each block of one request (stateless, so it can re-hash any block).

    Args:
        context: the request's hashing context.
        hash_block_size: tokens per hashed block (indexes the prompt-embeds digests).

    Raises:
        InvalidArgument: a multimodal item with a negative offset or a non-positive length,
            or a digest that is not bytes.
    """

    __slots__ = ("_block_size", "_digests", "_lora", "_mm", "_mm_end", "_prefix_max_end", "_salt")

    def __init__(self, context: HashingContext, hash_block_size: int) -> None:
        self._block_size = hash_block_size
        self._lora: tuple[Any, ...] | None = (
            ("lora", context.lora_name, context.lora_path) if context.lora_name else None
        )
        self._salt: tuple[Any, ...] | None = (
            ("cache_salt", context.cache_salt) if context.cache_salt else None
        )
        # As objects: compiled, a declared int/bytes would fail before the check.
        digests: Sequence[object] = context.prompt_embeds_digests
        for i, digest in enumerate(digests):
            if not isinstance(digest, bytes):
                raise InvalidArgument(
                    f"hashing.prompt_embeds_digests[{i}]",
                    f"must be bytes, got {type(digest).__name__}",
                )
        self._digests = context.prompt_embeds_digests
        for i, item in enumerate(context.mm_items):
            if item.offset < 0 or item.length <= 0:
                raise InvalidArgument(
                    f"hashing.mm_items[{i}]",
                    f"needs offset >= 0 and length > 0, got offset={item.offset} "
                    f"length={item.length}",
                )
        # The reference assumes items sorted by offset; sort so callers need not.
        items = sorted(context.mm_items, key=lambda it: it.offset)
        self._mm: list[tuple[int, int, str]] = [
            (it.offset, it.length, it.identifier) for it in items
        ]
        # Items ending at or before a block's start can never appear in its keys: bisecting
        # this running maximum finds the first item worth looking at.
        self._prefix_max_end = list(accumulate([o + n for o, n, _ in self._mm], max))
        self._mm_end = self._prefix_max_end[-1] if self._mm else 0

    def __call__(self, start: int, end: int) -> ExtraKeys | None:
        """Extra keys of the block covering tokens ``[start, end)``, or None when it has none."""
        keys: list[tuple[Any, ...]] = []
        if self._lora is not None:
            keys.append(self._lora)
        if self._mm and start < self._mm_end:
            self._add_mm_keys(keys, start, end)
        if start == 0 and self._salt is not None:
            keys.append(self._salt)
        if self._digests:
            index = start // self._block_size
            if index < len(self._digests):
                keys.append(("prompt_embeds", self._digests[index]))
        return tuple(keys) if keys else None

    def _add_mm_keys(self, keys: list[tuple[Any, ...]], start: int, end: int) -> None:
        # Same walk as the reference: stop at the first item that starts after the block or
        # that runs past its end (the next item cannot start inside the block then).
        items = self._mm
        i = bisect_right(self._prefix_max_end, start)
        while i < len(items):
            offset, length, identifier = items[i]
            if end <= offset:
                break
            if start >= offset + length:
                i += 1
                continue
            keys.append(("mm", identifier, offset - start))
            if end >= offset + length:
                i += 1
            else:
                break


def _cbor_array_header(length: int) -> bytes:
    """Canonical CBOR header of an array of ``length`` items (major type 4, shortest form)."""
    if length < 24:
        return bytes((0x80 + length,))
    if length < 0x100:
        return bytes((0x98, length))
    if length < 0x10000:
        return b"\x99" + length.to_bytes(2, "big")
    return b"\x9a" + length.to_bytes(4, "big")


# Byte maps for ``bytes.translate``: nonzero -> 1, and >= 24 -> 1.
_NONZERO = bytes([0] + [1] * 255)
_AT_LEAST_24 = bytes([0] * 24 + [1] * 232)


def _cbor_uint_widths(packed: bytes, start: int, count: int) -> bytes:
    """Byte length of the CBOR encoding of each of ``count`` little-endian uint32s.

    Width is 1 below 24, 2 below 2**8, 3 below 2**16, 5 otherwise; computed on whole byte
    strings (big-int ORs and ``translate``) instead of per token. No byte exceeds 5, so the
    big-int sums never carry between tokens.
    """
    end = start + 4 * count
    frombytes = int.from_bytes
    low = packed[start:end:4]
    ge_65536 = frombytes(packed[start + 2 : end : 4], "little") | frombytes(
        packed[start + 3 : end : 4], "little"
    )
    ge_256 = ge_65536 | frombytes(packed[start + 1 : end : 4], "little")
    ge_65536 = frombytes(ge_65536.to_bytes(count, "little").translate(_NONZERO), "little")
    ge_256 = frombytes(ge_256.to_bytes(count, "little").translate(_NONZERO), "little")
    ge_24 = ge_256 | frombytes(low.translate(_AT_LEAST_24), "little")
    ones = frombytes(b"\x01" * count, "little")
    return (ones + ge_24 + ge_256 + 2 * ge_65536).to_bytes(count, "little")


_CBOR_NONE = b"\xf6"
# Array of three items whose first is a 32-byte string: the parent digest.
_CBOR_TRIPLE_WITH_32B_PARENT = b"\x83\x58\x20"


class BlockHasher:
    """Chained block hashes of one pool: algorithm, seed, and the first block's parent.

    Args:
        algo: ``"xxh3_128"`` or ``"sha256_cbor"``.
        block_size: tokens per hashed block (the pool's ``hash_block_size``).
        seed: derives ``NONE_HASH``. None means ``"vllm-none-hash"`` for ``sha256_cbor`` and a
            fresh random secret for ``xxh3_128``.

    Raises:
        ValueError: an unknown algorithm (the message lists the valid ones) or a block size < 1.
    """

    __slots__ = ("_array_header", "algo", "block_size", "none_hash", "seed")

    def __init__(self, algo: str = "xxh3_128", block_size: int = 16, seed: str | None = None):
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash_algo {algo!r}; valid: {', '.join(HASH_ALGOS)}")
        if block_size < 1:
            raise ValueError(f"hash block size must be >= 1, got {block_size}")
        self.algo = algo
        self.block_size = block_size
        if seed is None:
            seed = DEFAULT_SHA256_CBOR_SEED if algo == "sha256_cbor" else os.urandom(32).hex()
        self.seed: str = seed
        if algo == "sha256_cbor":
            self.none_hash: BlockHash = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
        else:
            self.none_hash = xxhash.xxh3_128_digest(seed.encode())
        self._array_header = _cbor_array_header(block_size)

    def hash_block(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
    ) -> BlockHash:
        """The hash of one full block (the reference's ``hash_block_tokens``).

        Args:
            parent: hash of the previous block; None (or empty) for the first block.
            token_ids: the block's tokens.
            extra_keys: the block's extra keys, or None.
        """
        if not parent:
            parent = self.none_hash
        if self.algo == "sha256_cbor":
            payload = cbor2.dumps((parent, tuple(token_ids), extra_keys), canonical=True)
            return hashlib.sha256(payload).digest()
        tail = b"" if extra_keys is None else cbor2.dumps(extra_keys, canonical=True)
        return xxhash.xxh3_128_digest(parent + _pack(token_ids) + tail)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        first_block: int,
        num_blocks: int,
        parent: BlockHash | None,
        extra_keys: BlockExtraKeys | None = None,
        packed: bytes | None = None,
    ) -> list[BlockHash]:
        """Hashes of ``num_blocks`` consecutive full blocks, chained from ``parent``.

        Args:
            token_ids: all of the request's tokens (only the blocks' slice is read).
            first_block: index of the first block to hash.
            num_blocks: how many blocks; ``token_ids`` must cover them completely.
            parent: hash of block ``first_block - 1``; None when ``first_block`` is 0.
            extra_keys: the request's extra keys, or None when it has none.
            packed: ``pack_token_ids(token_ids)`` (or a prefix covering the blocks) when the
                caller has it already; saves re-packing in ``xxh3_128`` mode.

        Raises:
            TypeError, struct.error: a token id that is not an int32 (callers validate first).
        """
        if num_blocks <= 0:
            return []
        bs = self.block_size
        start = first_block * bs
        assert len(token_ids) >= start + num_blocks * bs, "only full blocks are hashed"
        if parent is None:
            parent = self.none_hash
        # Both algorithms read the tokens as little-endian uint32 bytes (xxh3 hashes them,
        # sha256_cbor derives CBOR widths from them).
        if packed is None or len(packed) < 4 * (start + num_blocks * bs):
            chunk = token_ids[start : start + num_blocks * bs]
            if isinstance(chunk, array.array) and sys.byteorder == "little":
                packed = chunk.tobytes()  # the ids were checked when they were appended
            else:
                packed = _pack(chunk)
            base = 0
        else:
            base = 4 * start
        if self.algo == "sha256_cbor":
            return self._sha256_cbor_blocks(
                token_ids, start, num_blocks, parent, extra_keys, packed, base
            )
        return self._xxh3_blocks(packed, base, start, num_blocks, parent, extra_keys)

    def _xxh3_blocks(
        self,
        packed: bytes,
        base: int,
        start: int,
        num_blocks: int,
        parent: BlockHash,
        extra_keys: BlockExtraKeys | None,
    ) -> list[BlockHash]:
        # Block ``start`` begins at byte ``base`` of ``packed``; slice it per block.
        bs = self.block_size
        width = 4 * bs
        digest = xxhash.xxh3_128_digest
        out: list[BlockHash] = []
        append = out.append
        if extra_keys is None:
            for offset in range(base, base + num_blocks * width, width):
                parent = digest(parent + packed[offset : offset + width])
                append(parent)
            return out
        dumps = cbor2.dumps
        for i in range(num_blocks):
            offset = base + i * width
            block_start = start + i * bs
            keys = extra_keys(block_start, block_start + bs)
            tail = b"" if keys is None else dumps(keys, canonical=True)
            parent = digest(parent + packed[offset : offset + width] + tail)
            append(parent)
        return out

    def _sha256_cbor_blocks(
        self,
        token_ids: Sequence[int],
        start: int,
        num_blocks: int,
        parent: BlockHash,
        extra_keys: BlockExtraKeys | None,
        packed: bytes,
        base: int,
    ) -> list[BlockHash]:
        # cbor2 encodes the whole span in one call; each block's token bytes are then a
        # slice of it, located from the per-token widths. Per block this leaves one
        # concatenation and one sha256 in Python.
        bs = self.block_size
        count = num_blocks * bs
        span = token_ids[start : start + count]
        if not isinstance(span, list | tuple):
            span = list(span)
        body = cbor2.dumps(span)
        widths = _cbor_uint_widths(packed, base, count)
        offset = len(_cbor_array_header(count))
        header = self._array_header
        sha256 = hashlib.sha256
        dumps = cbor2.dumps
        out: list[BlockHash] = []
        append = out.append
        for i in range(num_blocks):
            end = offset + sum(widths[i * bs : (i + 1) * bs])
            if extra_keys is None:
                tail = _CBOR_NONE
            else:
                keys = extra_keys(start + i * bs, start + (i + 1) * bs)
                tail = _CBOR_NONE if keys is None else dumps(keys, canonical=True)
            if len(parent) == 32:
                head = _CBOR_TRIPLE_WITH_32B_PARENT + parent
            else:  # a caller-supplied parent of another length: let cbor2 frame it
                head = b"\x83" + dumps(parent)
            parent = sha256(head + header + body[offset:end] + tail).digest()
            append(parent)
            offset = end
        return out


class BlockHashListWithBlockSize:
    """Block hashes of a coarser group, read through the ``hash_block_size`` hashes.

    A group whose block is ``k`` hash blocks long uses, for its block ``i``, the hash of hash
    block ``(i + 1) * k - 1``: that hash already chains over the whole prefix the group block
    ends, so it fingerprints the group block as well (the reference's view of the same name)::

        hash blocks (16 tokens):  | 0-15: A | 16-31: B | 32-47: C | 48-63: D |
        group blocks (32 tokens): |      0-31: B       |      32-63: D       |
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(
        self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        assert target_block_size % hash_block_size == 0
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            return [self._at(i) for i in range(start, stop, step)]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self._at(idx)

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._at(i)

    def _at(self, idx: int) -> BlockHash:
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]


BlockHashList = Sequence[BlockHash] | BlockHashListWithBlockSize


def hashes_at_block_size(
    block_hashes: Sequence[BlockHash], hash_block_size: int, block_size: int
) -> BlockHashList:
    """The hashes seen by a group of ``block_size`` (the list itself when the sizes match)."""
    if block_size == hash_block_size:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


@lru_cache(maxsize=256)
def _packer(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}I")


def _pack(token_ids: Sequence[int]) -> bytes:
    # Unsigned packing rejects negative ids; for ids below 2**31 the bytes equal int32's.
    return _packer(len(token_ids)).pack(*token_ids)


def pack_token_ids(token_ids: Sequence[int], field: str) -> bytes:
    """The ids as little-endian int32 bytes, checking each is an int in [0, 2**31).

    One C-level pass does both jobs (``min``/``max`` over Python ints is several times
    slower): packing as uint32 rejects non-ints, negatives and ids >= 2**32, and the high
    byte of every id must be below 0x80, which ``isascii`` checks on the strided bytes.

    Raises:
        InvalidArgument: naming ``field``, the first bad id and its index.
    """
    if not token_ids:
        return b""
    try:
        packed = _pack(token_ids)
    except struct.error:
        raise _bad_token_error(token_ids, field) from None
    if not packed[3::4].isascii():
        raise _bad_token_error(token_ids, field)
    return packed


def unpack_token_ids(packed: bytes, field: str) -> array.array[int]:
    """Token ids from their packed form (little-endian 32-bit), checked like the list form.

    The wire may carry a prompt this way. The ids stay in an ``array('I')``, which the
    core keeps as the request's token sequence: no Python int is made per token (for a
    2048-token prompt that is the difference between ~2 us and ~45 us).

    Raises:
        InvalidArgument: a length that is not a multiple of 4, or an id >= 2**31.
    """
    if len(packed) % 4:
        raise InvalidArgument(field, f"packed token ids need 4 bytes each, got {len(packed)} bytes")
    values = array.array("I")
    values.frombytes(packed)
    if sys.byteorder == "big":
        values.byteswap()
    if not packed[3::4].isascii():
        raise _bad_token_error(values, field)
    return values


def _bad_token_error(token_ids: Sequence[int], field: str) -> InvalidArgument:
    # As objects: compiled, a declared int/bytes would fail before the check.
    unchecked: Sequence[object] = token_ids
    for i, token in enumerate(unchecked):
        if not isinstance(token, int):
            return InvalidArgument(
                field, f"token ids must be integers; [{i}] is {type(token).__name__}"
            )
        if not 0 <= token < MAX_TOKEN_ID_EXCLUSIVE:
            return InvalidArgument(
                field, f"token ids must be in [0, {MAX_TOKEN_ID_EXCLUSIVE}); [{i}] is {token}"
            )
    return InvalidArgument(field, "token ids must be int32 values")


def validate_token_ids(token_ids: Sequence[int], field: str) -> None:
    """Check that every token id is an int in [0, 2**31) (what the wire and hashing carry).

    Raises:
        InvalidArgument: naming ``field``, the first bad id and its index.
    """
    if len(token_ids) == 1:
        # As objects: compiled, a declared int/bytes would fail before the check.
        unchecked: Sequence[object] = token_ids
        token = unchecked[0]
        if type(token) is int and 0 <= token < MAX_TOKEN_ID_EXCLUSIVE:
            return
    pack_token_ids(token_ids, field)
