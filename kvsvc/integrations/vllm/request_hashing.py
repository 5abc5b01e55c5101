"""What keys a vLLM request's blocks besides its tokens, in kvsvc's terms.

vLLM hashes a block from its tokens and the request's extra keys: the cache salt, the
LoRA adapter, multimodal items overlapping the block and prompt-embedding digests. The
engine sends that context to the server with each admission (the client's
:class:`kvsvc_client.HashingContext`), and its replica of the pool hashes with the same
context (the core's), so both find the same prefix hits as stock vLLM.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvsvc_client import HashingContext, MultiModalItem

from kvsvc.core.hashing import HashingContext as CoreHashingContext
from kvsvc.core.hashing import MultiModalItem as CoreMultiModalItem


def core_hashing(hashing: HashingContext | None) -> CoreHashingContext | None:
    """The client's hashing context as the core's (the same fields)."""
    if hashing is None:
        return None
    return CoreHashingContext(
        cache_salt=hashing.cache_salt or None,
        lora_name=hashing.lora_name or None,
        lora_path=hashing.lora_path or None,
        mm_items=tuple(
            CoreMultiModalItem(item.identifier, item.offset, item.length)
            for item in hashing.mm_items
        ),
        prompt_embeds_digests=tuple(hashing.prompt_embeds_digests),
        lora_id=hashing.lora_id or None,
    )


def hashing_context(request: Any, block_size: int) -> HashingContext | None:
    """The hashing context of a vLLM request: what besides its tokens keys its blocks."""
    lora = getattr(request, "lora_request", None)
    items = tuple(
        MultiModalItem(str(f.identifier), f.mm_position.offset, f.mm_position.length)
        for f in getattr(request, "mm_features", None) or ()
    )
    digests: list[bytes] = []
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        # One digest per full block of the embeddings, as vLLM keys such blocks.
        data = embeds.detach().cpu().contiguous()
        for start in range(0, (data.shape[0] // block_size) * block_size, block_size):
            chunk = data[start : start + block_size].numpy().tobytes()
            digests.append(hashlib.sha256(chunk).digest())
    context = HashingContext(
        cache_salt=getattr(request, "cache_salt", None) or "",
        lora_name=lora.lora_name if lora is not None else "",
        lora_path=(getattr(lora, "lora_path", None) or "") if lora is not None else "",
        mm_items=items,
        prompt_embeds_digests=tuple(digests),
        lora_id=int(lora.lora_int_id) if lora is not None else 0,
    )
    return None if context == HashingContext() else context
