"""How large each method's request can be, from the documented bounds: what a request may
be before it is parsed.

``max_message_bytes`` (64 MiB) is what Step, Free and the agents' reports may need; most
methods need far less. A ``Lookup`` or an ``Allocate`` carries one prompt of at most the
pool's ``max_model_len`` tokens and one hashing context (its strings, multimodal items
and prompt-embedding digests each bounded, see the Limits table), so a 60 MiB Lookup can
only be refused, and parsing it first cost as much again as reading it (and packed
varints four times that). A request over its method's cap is refused RESOURCE_EXHAUSTED
naming the cap: over frames before its body is read (the frame's prefix gives its size),
over gRPC once its bytes are in but before they are parsed.

The caps follow the pools: a prompt's bound is the largest ``max_model_len`` of the pools
serving now (a pool not serving answers a Lookup FAILED_PRECONDITION anyway); with none
serving, a prompt method has no cap below ``max_message_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvsvc.core import (
    MAX_HASHING_STRING_BYTES,
    MAX_LORA_PATH_BYTES,
    MAX_MM_IDENTIFIER_BYTES,
    MAX_MM_ITEMS,
)

# Requests of a pool name, a request id, a call id, a rank and session, a service name:
# a few hundred bytes; this leaves room for any name a config allows.
SMALL_REQUEST_BYTES = 64 * 1024
# Methods whose request is small whatever the pool (services' short names: the gRPC path's
# last part; their services are the server's own or health's).
_SMALL = frozenset(
    {
        "GetUsage",
        "GetBlockTable",
        "ResetPrefixCache",
        "WatchEvents",
        "SnapshotIndex",
        "ListPools",
        "GetPlan",
        "ForceResetPrefixCache",
        "SnapshotPool",
        "Heartbeat",
        "WatchPlan",
        "Check",
        "Watch",
    }
)
# Methods whose request is one prompt and its hashing context.
_PROMPT = frozenset({"Lookup", "Allocate"})
# One hashing context at most: every multimodal item (its identifier and offsets), the
# salt, the LoRA name and path; plus the request id, call id, pool and counts.
_CONTEXT_BYTES = (
    MAX_MM_ITEMS * (MAX_MM_IDENTIFIER_BYTES + 32)
    + 2 * (MAX_HASHING_STRING_BYTES + 8)
    + MAX_LORA_PATH_BYTES
    + SMALL_REQUEST_BYTES
)
# A token id on the wire: a varint of up to 5 bytes (or 4, packed).
_TOKEN_BYTES = 5


class RequestCaps:
    """The request cap of each method (``/package.Service/Method``), for the listeners."""

    def __init__(self, pools: Mapping[str, Any], max_message_bytes: int) -> None:
        """``pools``: the server's pools by name (each a
        :class:`~kvsvc.server.pool.Pool`; read when a prompt method's request is large)."""
        self._pools = pools
        self._max_message_bytes = max_message_bytes

    def __call__(self, method: str) -> int:
        name = method.rpartition("/")[2]
        if name in _SMALL:
            return SMALL_REQUEST_BYTES
        if name in _PROMPT:
            return min(self._max_message_bytes, self.prompt_bytes())
        return self._max_message_bytes

    def prompt_bytes(self) -> int:
        """The largest request of one prompt any serving pool takes: its tokens as
        varints, one prompt-embedding digest per hash block, one hashing context."""
        largest = 0
        for pool in self._pools.values():
            cache = pool.cache
            if cache is None:
                continue
            tokens = cache.max_model_len
            digests = tokens // max(1, cache.manager.hash_block_size) + 1
            largest = max(largest, tokens * _TOKEN_BYTES + digests * (MAX_HASHING_STRING_BYTES + 4))
        if not largest:
            return self._max_message_bytes
        return largest + _CONTEXT_BYTES

    def refusal(self, method: str, size: int, cap: int) -> str:
        """What a caller whose request is over its cap is told."""
        name = method.rpartition("/")[2]
        why = (
            "one prompt of the largest max_model_len of the pools serving, and one hashing context"
            if name in _PROMPT
            else "what the method's request holds"
        )
        return (
            f"a {name} request of {size} bytes is over its bound of {cap} bytes ({why}); "
            "nothing of it was parsed"
        )
