"""Mamba state shapes and the page alignment hybrid attention + Mamba models need.

One block id addresses one page in every KV cache group, so a hybrid model's Mamba state
page and its attention page must be the same size. vLLM's
``HybridAttentionMambaModelConfig.verify_and_update_config`` arranges it before any spec
exists: it raises the attention block size until an attention page holds a Mamba state,
then pads the Mamba page up to the attention page. :func:`align_attention_to_mamba` does the
same arithmetic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvsvc.models.parallel import shard
from kvsvc.specs import MAMBA_CACHE_MODES, cdiv

# Attention kernels want block sizes in multiples of these (FlashAttention 16; the MLA
# backends 64).
KERNEL_BLOCK_ALIGNMENT = 16
MLA_KERNEL_BLOCK_ALIGNMENT = 64
# Mamba2's SSD kernel chunk; cache mode "all" aligns blocks to it.
DEFAULT_MAMBA_CHUNK_SIZE = 256


def mamba1_state_shapes(
    tp: int, intermediate_size: int, state_size: int, conv_kernel: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(conv state, SSM state) shapes of one Mamba-1 layer on one TP rank.

    The conv state keeps the last ``conv_kernel - 1`` inputs of the rank's channel slice,
    stored state-length first (vLLM's default "SD" layout; the page size is the same either
    way); the SSM state is ``(channels, d_state)``.
    """
    channels = shard(intermediate_size, tp, "mamba intermediate size")
    return (conv_kernel - 1, channels), (channels, state_size)


class MambaAlignment(NamedTuple):
    """Result of :func:`align_attention_to_mamba`."""

    attention_block_size: int
    mamba_block_size: int
    mamba_page_size_padded: int


def align_attention_to_mamba(
    *,
    attention_page_per_token: int,
    mamba_page_size: int,
    block_size: int,
    mamba_cache_mode: str,
    max_model_len: int,
    mamba_block_size: int | None = None,
    kernel_block_alignment: int = KERNEL_BLOCK_ALIGNMENT,
    mamba_chunk_size: int = DEFAULT_MAMBA_CHUNK_SIZE,
) -> MambaAlignment:
    """Pick the attention block size and Mamba page padding so both pages are equal.

    Without prefix caching of Mamba state (``none``/``align``) the smallest kernel-aligned
    attention block whose page holds one Mamba state is used, to waste the least padding.
    With ``all`` (a state per block) the block is a multiple of the SSD chunk size so state
    checkpoints fall on chunk boundaries. A user block size that is already larger wins.

    Mamba's own block size is ``max_model_len`` in mode ``none`` (one state per request,
    whatever its length), the attention block size in ``align``, and the chunk-aligned
    block in ``all``, unless ``mamba_block_size`` sets it.
    """
    if mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise ValueError(f"unknown mamba_cache_mode {mamba_cache_mode!r}")
    if mamba_cache_mode == "all":
        chunk = math.lcm(mamba_block_size or mamba_chunk_size, kernel_block_alignment)
        tokens_per_state = cdiv(mamba_page_size, attention_page_per_token)
        needed = chunk * cdiv(tokens_per_state, chunk)
        resolved_mamba_block = needed
    else:
        needed = kernel_block_alignment * cdiv(
            mamba_page_size, kernel_block_alignment * attention_page_per_token
        )
        resolved_mamba_block = mamba_block_size or max_model_len
    attn_block = max(block_size, needed)
    if mamba_cache_mode == "align":
        resolved_mamba_block = attn_block
    attn_page = attn_block * attention_page_per_token
    if mamba_page_size > attn_page:
        # Only reachable with an unaligned user block: grow the block to fit the state.
        attn_block = cdiv(mamba_page_size, attention_page_per_token)
        attn_page = attn_block * attention_page_per_token
    return MambaAlignment(attn_block, resolved_mamba_block, attn_page)
