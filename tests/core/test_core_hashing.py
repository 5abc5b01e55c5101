"""Block hashing: golden sha256_cbor digests, extra keys, seeds, the block-size view."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsvc.core import (
    BlockExtraKeys,
    BlockHasher,
    BlockHashListWithBlockSize,
    HashingContext,
    MultiModalItem,
)
from kvsvc.core.hashing import _cbor_uint_widths, pack_token_ids, validate_token_ids
from kvsvc.errors import InvalidArgument


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's sha256_cbor, written from its definition (not through kvsvc)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


# Tokens from every CBOR integer width: 1, 2, 3, 5 bytes.
WIDE_TOKENS = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1] * 2


def test_none_hash_of_the_default_seed_is_vllms() -> None:
    hasher = BlockHasher("sha256_cbor", 4)
    assert hasher.seed == "vllm-none-hash"
    # Derived once with hashlib + cbor2: sha256(cbor2.dumps("vllm-none-hash")).
    assert hasher.none_hash.hex() == (
        "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
    )
    first = hasher.hash_blocks([0, 23, 24, 255], 0, 1, None)[0]
    assert first.hex() == "dc7fbfd287fac7b6243222eb8a406c3a145df86542e11806ae74c52db0f7a8e2"


@pytest.mark.parametrize("seed", [None, "shared-seed"])
def test_sha256_cbor_chain_matches_the_documented_algorithm(seed: str | None) -> None:
    block_size = 4
    hasher = BlockHasher("sha256_cbor", block_size, seed)
    parent = sha256_cbor(seed or "vllm-none-hash")
    expected = []
    for start in range(0, len(WIDE_TOKENS), block_size):
        parent = sha256_cbor((parent, tuple(WIDE_TOKENS[start : start + block_size]), None))
        expected.append(parent)
    assert hasher.hash_blocks(WIDE_TOKENS, 0, 4, None) == expected
    # The single-block primitive agrees, and so does hashing the tail on its own.
    assert hasher.hash_block(None, WIDE_TOKENS[:4]) == expected[0]
    assert hasher.hash_blocks(WIDE_TOKENS, 2, 2, expected[1]) == expected[2:]


def test_sha256_cbor_with_extra_keys_matches_the_documented_algorithm() -> None:
    context = HashingContext(
        cache_salt="tenant-a",
        lora_name="adapter",
        lora_path="/adapters/a",
        mm_items=(MultiModalItem("img-hash", offset=2, length=5),),
        prompt_embeds_digests=(b"\x01" * 32,),
    )
    hasher = BlockHasher("sha256_cbor", 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    first_keys = (
        ("lora", "adapter", "/adapters/a"),
        ("mm", "img-hash", 2),
        ("cache_salt", "tenant-a"),
        ("prompt_embeds", b"\x01" * 32),
    )
    second_keys = (("lora", "adapter", "/adapters/a"), ("mm", "img-hash", -2))
    h0 = sha256_cbor((sha256_cbor("vllm-none-hash"), (5, 6, 7, 8), first_keys))
    h1 = sha256_cbor((h0, (9, 10, 11, 12), second_keys))
    assert hasher.hash_blocks(tokens, 0, 2, None, BlockExtraKeys(context, 4)) == [h0, h1]
    assert hasher.hash_block(None, tokens[:4], first_keys) == h0


def test_sha256_cbor_parent_of_another_length_is_framed_by_cbor() -> None:
    hasher = BlockHasher("sha256_cbor", 3)
    assert hasher.hash_blocks([1, 2, 3], 0, 1, b"123") == [sha256_cbor((b"123", (1, 2, 3), None))]


def test_extra_keys_follow_multimodal_items_across_blocks() -> None:
    # The reference's scenario: [T*10, P0*6][P0*4, T*10, P1*2][P1*16][P2*7, ...].
    context = HashingContext(
        mm_items=(
            MultiModalItem("ccc", offset=48, length=7),
            MultiModalItem("aaa", offset=11, length=10),
            MultiModalItem("bbb", offset=30, length=18),
        )
    )
    keys = BlockExtraKeys(context, 16)
    assert keys(0, 16) == (("mm", "aaa", 11),)
    assert keys(16, 32) == (("mm", "aaa", -5), ("mm", "bbb", 14))
    assert keys(32, 48) == (("mm", "bbb", -2),)
    assert keys(48, 64) == (("mm", "ccc", 0),)
    assert keys(64, 80) is None


def test_salt_goes_on_the_first_block_only_and_lora_on_every_block() -> None:
    keys = BlockExtraKeys(HashingContext(cache_salt="s", lora_name="l"), 4)
    assert keys(0, 4) == (("lora", "l", None), ("cache_salt", "s"))
    assert keys(4, 8) == (("lora", "l", None),)
    assert BlockExtraKeys(HashingContext(lora_path="/only/a/path"), 4)(0, 4) is None


def test_prompt_embeds_digest_per_block_then_none() -> None:
    keys = BlockExtraKeys(HashingContext(prompt_embeds_digests=(b"a", b"b")), 4)
    assert keys(0, 4) == (("prompt_embeds", b"a"),)
    assert keys(4, 8) == (("prompt_embeds", b"b"),)
    assert keys(8, 12) is None


def test_bad_hashing_contexts_name_the_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        BlockExtraKeys(HashingContext(mm_items=(MultiModalItem("x", offset=-1, length=2),)), 4)
    assert err.value.field == "hashing.mm_items[0]"
    with pytest.raises(InvalidArgument) as err:
        BlockExtraKeys(HashingContext(prompt_embeds_digests=(b"ok", "str")), 4)  # type: ignore[arg-type]
    assert err.value.field == "hashing.prompt_embeds_digests[1]"


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor"])
def test_extra_keys_change_the_hash(algo: str) -> None:
    hasher = BlockHasher(algo, 4, seed="s")
    tokens = [1, 2, 3, 4]
    plain = hasher.hash_blocks(tokens, 0, 1, None)
    salted = hasher.hash_blocks(tokens, 0, 1, None, BlockExtraKeys(HashingContext("x"), 4))
    other = hasher.hash_blocks(tokens, 0, 1, None, BlockExtraKeys(HashingContext("y"), 4))
    assert len({plain[0], salted[0], other[0]}) == 3


def test_xxh3_seed_is_random_by_default_and_decides_the_hashes() -> None:
    a = BlockHasher("xxh3_128", 4)
    b = BlockHasher("xxh3_128", 4)
    assert a.seed != b.seed and len(a.seed) == 64
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    assert a.hash_blocks(tokens, 0, 2, None) != b.hash_blocks(tokens, 0, 2, None)
    # A persisted seed reproduces them.
    c = BlockHasher("xxh3_128", 4, seed=a.seed)
    assert c.hash_blocks(tokens, 0, 2, None) == a.hash_blocks(tokens, 0, 2, None)
    assert len(a.none_hash) == 16


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256_cbor"])
def test_incremental_hashing_equals_one_pass(algo: str) -> None:
    hasher = BlockHasher(algo, 4, seed="s")
    tokens = list(range(100, 124))
    keys = BlockExtraKeys(HashingContext(mm_items=(MultiModalItem("m", 3, 9),)), 4)
    once = hasher.hash_blocks(tokens, 0, 6, None, keys)
    stepwise: list[bytes] = []
    for i in range(6):
        stepwise += hasher.hash_blocks(tokens, i, 1, stepwise[-1] if stepwise else None, keys)
    assert once == stepwise
    # Packed bytes supplied by the caller give the same result.
    assert hasher.hash_blocks(tokens, 2, 4, once[1], keys, pack_token_ids(tokens, "t")) == once[2:]


def test_xxh3_hash_is_parent_plus_int32_tokens() -> None:
    import xxhash

    hasher = BlockHasher("xxh3_128", 2, seed="s")
    none_hash = xxhash.xxh3_128_digest(b"s")
    expected = xxhash.xxh3_128_digest(
        none_hash + (7).to_bytes(4, "little") + (9).to_bytes(4, "little")
    )
    assert hasher.hash_blocks([7, 9], 0, 1, None) == [expected]


def test_unknown_algorithm_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="xxh3_128, sha256_cbor"):
        BlockHasher("md5", 16)


def test_block_size_view_uses_the_last_hash_of_each_coarse_block() -> None:
    view = BlockHashListWithBlockSize([b"A", b"B", b"C", b"D", b"E"], 16, 32)
    assert len(view) == 2
    assert list(view) == [b"B", b"D"]
    assert view[1] == b"D" and view[-1] == b"D"
    assert view[0:2] == [b"B", b"D"]
    with pytest.raises(IndexError):
        view[2]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1], r"\[1\] is -1"),
        ([2**31], r"\[0\] is 2147483648"),
        ([1, 2, 2**40], r"\[2\] is"),
        ([1, 2.5], r"\[1\] is float"),
        (["a"], r"\[0\] is str"),
    ],
)
def test_token_validation_names_the_field_and_the_culprit(tokens: list[Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as err:
        pack_token_ids(tokens, "new_token_ids")
    assert err.value.field == "new_token_ids"
    with pytest.raises(InvalidArgument):
        validate_token_ids(tokens, "new_token_ids")


def test_token_validation_accepts_the_whole_int32_range() -> None:
    assert pack_token_ids([0, 2**31 - 1], "t") == b"\x00\x00\x00\x00\xff\xff\xff\x7f"
    validate_token_ids([2**31 - 1], "t")
    validate_token_ids([], "t")


@settings(deadline=None, max_examples=200)
@given(
    st.lists(
        st.one_of(st.integers(0, 300), st.integers(0, 2**16 + 5), st.integers(0, 2**31 - 1)),
        min_size=1,
        max_size=40,
    )
)
def test_cbor_widths_match_cbor2(tokens: list[int]) -> None:
    packed = b"\xaa" * 8 + pack_token_ids(tokens, "t")
    widths = _cbor_uint_widths(packed, 8, len(tokens))
    assert list(widths) == [len(cbor2.dumps(t, canonical=True)) for t in tokens]


@pytest.mark.parametrize("block_size", [1, 4, 23, 24, 32, 255, 256, 300])
def test_golden_digests_for_every_header_and_integer_width(block_size: int) -> None:
    # Block sizes cover 1-, 2- and 3-byte CBOR array headers; tokens every integer width.
    rng = random.Random(block_size)
    widths = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1]
    tokens = [rng.choice(widths) + rng.randrange(0, 2) for _ in range(3 * block_size)]
    tokens = [min(t, 2**31 - 1) for t in tokens]
    parent = sha256_cbor("vllm-none-hash")
    expected = []
    for i in range(3):
        parent = sha256_cbor((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None))
        expected.append(parent)
    hasher = BlockHasher("sha256_cbor", block_size)
    assert hasher.hash_blocks(tokens, 0, 3, None) == expected
    assert hasher.hash_blocks(tokens, 1, 2, expected[0]) == expected[1:]
