"""Bytes of a pool's state (:meth:`PoolKVCache.to_state`) and back, without pickle.

The encoding is explicit: every field is written by name, large number columns as packed
little-endian arrays (a million-block pool's reference counts, free-queue links and block
hashes are a few memcpy's, not a million objects), the rest as CBOR (the ``cbor2`` the
hashing already depends on; its decoder builds only plain values, never objects named by
the data). ``decode_state(encode_state(s)) == s`` for every state.

Layout: ``MAGIC`` (8 bytes, the format's version in its last byte), a canonical CBOR map
of the fields, then the packed columns it refers to by index. Integrity (a checksum of
these bytes) and identity (which pool, which plan) are the storage layer's business
(:mod:`kvsvc.server.persistence`).

Pure functions, no I/O: the server runs them in a thread while the pool keeps serving.
"""

from __future__ import annotations

import array
import itertools
import struct
import sys
from itertools import compress
from typing import Any

import cbor2

MAGIC = b"KVSVCST\x01"
_LITTLE = sys.byteorder == "little"


class StateFormatError(ValueError):
    """Bytes that are not an encoded pool state of this version (the message says why)."""


def _pack(typecode: str, values: Any) -> bytes:
    """``values`` as a little-endian array of ``typecode``."""
    packed = values if isinstance(values, array.array) and values.typecode == typecode else None
    if packed is None:
        packed = array.array(typecode, values)
    if not _LITTLE:
        packed = array.array(typecode, packed)
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes) -> array.array[int]:
    values = array.array(typecode)
    if len(data) % values.itemsize:
        raise StateFormatError(f"a packed {typecode!r} column of {len(data)} bytes")
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values


class _Sections:
    """Large byte strings kept out of the CBOR header (cbor2 copies big byte strings
    slowly: ~20 ms per MiB to encode): the header holds their index."""

    def __init__(self) -> None:
        self.blobs: list[bytes] = []

    def add(self, data: bytes) -> int:
        self.blobs.append(data)
        return len(self.blobs) - 1


def _pack_hashes(hashes: list[bytes], sections: _Sections) -> list[Any]:
    """``[width, section]`` when every hash has one width (always, for one pool's
    hasher), else ``[0, hashes]``."""
    if not hashes:
        return [0, []]
    width = len(hashes[0])
    joined = b"".join(hashes)
    if width and len(joined) == width * len(hashes):
        return [width, sections.add(joined)]
    return [0, list(hashes)]


def _unpack_hashes(packed: list[Any], sections: list[bytes]) -> list[bytes]:
    width, ref = packed
    if not width:
        return list(ref)
    data = sections[ref]
    if len(data) % width:
        raise StateFormatError(f"{len(data)} bytes of {width}-byte hashes")
    return [data[i : i + width] for i in range(0, len(data), width)]


def _encode_block_pool(pool: dict[str, Any], sections: _Sections) -> dict[str, Any]:
    block_hash = pool["block_hash"]
    # Hashes are non-empty bytes: compress and filter keep exactly the cached blocks.
    cached = list(compress(range(len(block_hash)), block_hash))
    hashes: list[bytes] = list(filter(None, block_hash))
    queue = pool["free_queue"]
    ref_cnt = pool["ref_cnt"]
    return {
        **{k: v for k, v in pool.items() if k not in ("ref_cnt", "block_hash", "free_queue")},
        # The null block's count is a large constant: int32 holds every other one.
        "null_ref_cnt": ref_cnt[0],
        "ref_cnt": sections.add(
            _pack("i", itertools.chain((0,), itertools.islice(ref_cnt, 1, None)))
        ),
        "cached_ids": sections.add(_pack("i", cached)),
        "cached_hashes": _pack_hashes(hashes, sections),
        "free_queue": {
            **queue,
            "stack": sections.add(_pack("i", queue["stack"])),
            "next": sections.add(_pack("i", queue["next"])),
            "prev": sections.add(_pack("i", queue["prev"])),
        },
    }


def _decode_block_pool(data: dict[str, Any], sections: list[bytes]) -> dict[str, Any]:
    n = data["num_blocks"]
    block_hash: list[bytes | None] = [None] * n
    ids = _unpack("i", sections[data["cached_ids"]])
    hashes = _unpack_hashes(data["cached_hashes"], sections)
    if len(ids) != len(hashes) or (len(ids) and not 0 < min(ids) <= max(ids) < n):
        raise StateFormatError("cached block ids do not match their hashes")
    # C-level iteration: no Python frame per block.
    any(map(block_hash.__setitem__, ids, hashes))
    queue = data["free_queue"]
    out = {
        k: v
        for k, v in data.items()
        if k not in ("null_ref_cnt", "ref_cnt", "cached_ids", "cached_hashes")
    }
    ref_cnt = _unpack("i", sections[data["ref_cnt"]]).tolist()
    if len(ref_cnt) != n:
        raise StateFormatError(f"{len(ref_cnt)} reference counts for {n} blocks")
    ref_cnt[0] = data["null_ref_cnt"]
    out["ref_cnt"] = ref_cnt
    out["block_hash"] = block_hash
    out["free_queue"] = {
        **queue,
        "stack": _unpack("i", sections[queue["stack"]]),
        "next": _unpack("i", sections[queue["next"]]),
        "prev": _unpack("i", sections[queue["prev"]]),
    }
    return out


def _encode_request(record: list[Any], sections: _Sections) -> list[Any]:
    # [id, tokens, num_prompt, num_computed, block_hashes, hashing, skip, resumed,
    #  num_encoder, groups, *newer]; groups: per group [table | None, num_cached,
    #  *extras]; newer: fields kept since (shared_prefix_boundary), absent in old states.
    groups = [
        [None if entry[0] is None else sections.add(_pack("i", entry[0])), *entry[1:]]
        for entry in record[9]
    ]
    return [
        record[0],
        sections.add(_pack("I", record[1])),
        *record[2:4],
        _pack_hashes(record[4], sections),
        *record[5:9],
        groups,
        *record[10:],
    ]


def _decode_request(data: list[Any], sections: list[bytes]) -> list[Any]:
    groups = [
        [None if entry[0] is None else _unpack("i", sections[entry[0]]).tolist(), *entry[1:]]
        for entry in data[9]
    ]
    return [
        data[0],
        _unpack("I", sections[data[1]]),
        *data[2:4],
        _unpack_hashes(data[4], sections),
        *data[5:9],
        groups,
        *data[10:],
    ]


_LENGTH = struct.Struct("<Q")


def encode_state(state: dict[str, Any]) -> bytes:
    """The bytes of a :meth:`PoolKVCache.to_state` result: ``MAGIC``, the CBOR header's
    length and the header, the number of sections and their lengths, the sections.

    Raises:
        StateFormatError: a state without the expected fields.
    """
    sections = _Sections()
    try:
        manager = state["manager"]
        body = {
            **state,
            "manager": {
                **manager,
                "block_pool": _encode_block_pool(manager["block_pool"], sections),
            },
            "requests": [_encode_request(r, sections) for r in state["requests"]],
        }
    except (KeyError, IndexError, TypeError) as exc:
        raise StateFormatError(f"not a pool state: {exc!r}") from None
    header = cbor2.dumps(body, canonical=True)
    blobs = sections.blobs
    lengths = array.array("Q", map(len, blobs))
    if not _LITTLE:
        lengths.byteswap()
    return b"".join(
        [
            MAGIC,
            _LENGTH.pack(len(header)),
            header,
            _LENGTH.pack(len(blobs)),
            lengths.tobytes(),
            *blobs,
        ]
    )


def decode_state(data: bytes) -> dict[str, Any]:
    """The state ``encode_state`` wrote.

    Raises:
        StateFormatError: bytes of another format or version, or damaged ones.
    """
    if data[: len(MAGIC) - 1] != MAGIC[:-1]:
        raise StateFormatError("not an encoded kvsvc pool state (bad magic)")
    if data[len(MAGIC) - 1] != MAGIC[-1]:
        raise StateFormatError(
            f"pool state encoding version {data[len(MAGIC) - 1]}; this kvsvc reads {MAGIC[-1]}"
        )
    try:
        pos = len(MAGIC)
        (header_len,) = _LENGTH.unpack_from(data, pos)
        pos += _LENGTH.size
        body = cbor2.loads(data[pos : pos + header_len])
        pos += header_len
        (count,) = _LENGTH.unpack_from(data, pos)
        pos += _LENGTH.size
        lengths = _unpack("Q", data[pos : pos + 8 * count])
        pos += 8 * count
        if len(lengths) != count or pos + sum(lengths) != len(data):
            raise StateFormatError("damaged pool state: its sections do not add up")
        view = memoryview(data)
        sections: list[bytes] = []
        for length in lengths:
            sections.append(bytes(view[pos : pos + length]))
            pos += length
        manager = body["manager"]
        return {
            **body,
            "manager": {
                **manager,
                "block_pool": _decode_block_pool(manager["block_pool"], sections),
            },
            "requests": [_decode_request(r, sections) for r in body["requests"]],
        }
    except StateFormatError:
        raise
    except Exception as exc:  # cbor2, struct and indexing fail in several ways; all mean this
        raise StateFormatError(f"damaged pool state: {type(exc).__name__}: {exc}") from None
