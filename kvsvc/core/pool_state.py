"""A PoolKVCache's state as plain values, and back: what the server persists and restores.

:func:`pool_to_state` takes everything that decides what a pool answers next (its
requests, their admissions and tables, the block pool, the retry memory, the counters);
:func:`load_pool_state` makes a fresh pool of the same config into that pool again.
Encoding the values as bytes is :mod:`kvsvc.core.state`'s business. The facade's
``config_state``, ``to_state``, ``load_state`` and ``from_state`` are these functions.
"""

from __future__ import annotations

from typing import Any, TypeVar

from kvsvc.core.hashing import HashingContext
from kvsvc.core.pool_base import PoolKVCacheBase
from kvsvc.core.pool_types import AdmissionRecord, RequestStart
from kvsvc.core.request import RequestState, num_unscheduled_tokens
from kvsvc.specs import KVCacheConfig

PoolT = TypeVar("PoolT", bound=PoolKVCacheBase)


# The layout of PoolKVCache.to_state (bump the version when it changes).
STATE_FORMAT = "kvsvc.core.PoolKVCache"
STATE_VERSION = 1


def pool_config_state(cache: PoolKVCacheBase) -> dict[str, Any]:
    """What a saved state must have been made under to be loaded into ``cache``: the
    shape of the pool and its groups, the hashing settings (seed included: a secret
    for xxh3) and the length bound."""
    managers = cache.manager.coordinator.managers
    config: dict[str, Any] = {
        "num_blocks": cache.manager.block_pool.num_blocks,
        "groups": [[type(m).__name__, m.block_size] for m in managers],
        "hash_algo": cache.hash_algo,
        "hash_seed": cache.hash_seed,
        "hash_block_size": cache.hash_block_size,
        "enable_caching": cache.enable_caching,
        "max_model_len": cache.max_model_len,
    }
    interval = cache.manager.prefix_cache_retention_interval
    if interval is not None:
        # Absent for dense retention, so states saved before the setting existed load.
        config["prefix_cache_retention_interval"] = interval
    return config


def pool_to_state(cache: PoolKVCacheBase) -> dict[str, Any]:
    """Everything that decides what ``cache`` answers next, as plain values.

    Deterministic: two pools built from the same config and seed that were given the
    same calls have equal states, and a pool loaded from a state (:func:`load_pool_state`)
    answers every later call exactly as the original would (same block ids, eviction
    order, events and sequence numbers). Lists and arrays are copies, so the state
    can be encoded (:mod:`kvsvc.core.state`) while the pool goes on serving.

    Raises:
        ValueError: events are pending (take them first), or a group tracks requests
            the facade does not know (a bug: the state would not load).
    """
    managers = cache.manager.coordinator.managers
    requests = cache._requests
    for manager in managers:
        if manager.num_tracked_requests() != len(requests):
            raise ValueError(
                f"group {manager.group_id} tracks {manager.num_tracked_requests()} "
                f"requests, the pool {len(requests)}"
            )
    records = []
    for request_id, request in requests.items():
        record = request.to_state()
        record.append([m.request_state(request_id) for m in managers])
        # After the groups, so states without it (older ones) still load.
        record.append(request.shared_prefix_boundary)
        records.append(record)
    admissions = [
        [
            request_id,
            None if a.start.hashing is None else a.start.hashing.to_state(),
            a.start.skip_prefix_cache_read,
            a.start.resumed,
            a.start.num_encoder_tokens,
            a.num_new_tokens,
            a.num_lookahead_tokens,
            a.num_cached_tokens,
            a.num_scheduled_tokens,
            a.start.num_prompt_tokens,
        ]
        for request_id, a in cache._admissions.items()
    ]
    return {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "config": pool_config_state(cache),
        "limits": {
            "max_requests": cache.max_requests,
            "recently_freed": cache.recently_freed,
            "max_num_batched_tokens": cache.max_num_batched_tokens,
        },
        "manager": cache.manager.to_state(),
        "requests": records,
        "admissions": admissions,
        "freed": list(cache._freed),
        "recompute": sorted(cache._recompute),
        "num_preemptions": cache._num_preemptions,
        "num_invalidations": cache.num_invalidations,
    }


def load_pool_state(cache: PoolKVCacheBase, state: dict[str, Any]) -> None:
    """Make ``cache`` the pool :func:`pool_to_state` described (``cache`` must be fresh,
    built from the same config; its limits stay its own).

    Raises:
        ValueError: a state of another format, version or config (the message names
            the first difference); nothing is loaded then.
    """
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"not a pool state (format {state.get('format')!r})")
    if state.get("version") != STATE_VERSION:
        raise ValueError(
            f"pool state version {state.get('version')!r}; this kvsvc reads {STATE_VERSION}"
        )
    mine = pool_config_state(cache)
    for key, value in mine.items():
        theirs = state["config"].get(key)
        if theirs != value:
            shown = (
                "(the secret seeds differ)"
                if key == "hash_seed"
                else (f"{theirs!r}, this pool {value!r}")
            )
            raise ValueError(f"the state was made for another pool: {key} {shown}")
    manager = cache.manager
    managers = manager.coordinator.managers
    hasher = manager.hasher
    requests = {}
    for record in state["requests"]:
        request = RequestState.from_state(record[:9], hasher)
        if len(record) > 10:
            request.shared_prefix_boundary = record[10]
        if len(record[9]) != len(managers):
            raise ValueError(f"request {request.request_id!r} has entries for other groups")
        requests[request.request_id] = (request, record[9])
    manager.load_state(state["manager"])
    cache._requests.clear()
    cache.num_tokens_held = cache.num_tokens_unscheduled = 0
    for request_id, (request, entries) in requests.items():
        cache._requests[request_id] = request
        cache.num_tokens_held += request.num_tokens
        cache.num_tokens_unscheduled += num_unscheduled_tokens(request)
        for m, entry in zip(managers, entries, strict=True):
            m.load_request_state(request_id, entry)
    cache._admissions.clear()
    for (
        request_id,
        hashing,
        skip,
        resumed,
        num_encoder_tokens,
        num_new,
        num_lookahead,
        num_cached,
        num_scheduled,
        *newer,
    ) in state["admissions"]:
        start = RequestStart(
            hashing=None if hashing is None else HashingContext.from_state(hashing),
            skip_prefix_cache_read=skip,
            resumed=resumed,
            num_encoder_tokens=num_encoder_tokens,
            # Absent from states saved before it was kept.
            num_prompt_tokens=newer[0] if newer else 0,
        )
        cache._admissions[request_id] = AdmissionRecord(
            start, num_new, num_lookahead, num_cached, num_scheduled
        )
    cache._freed.clear()
    cache._freed.update(dict.fromkeys(state["freed"]))
    cache._recompute.clear()
    cache._recompute.update(state["recompute"])
    cache._num_preemptions = state["num_preemptions"]
    cache.num_invalidations = state["num_invalidations"]
    cache._trim_freed()


def pool_from_state(
    pool_class: type[PoolT], config: KVCacheConfig, state: dict[str, Any], **kwargs: Any
) -> PoolT:
    """A ``pool_class`` built from ``config`` with the state's hashing settings and
    limits, then loaded with ``state``. ``kwargs`` go to the constructor
    (``enable_events``, ...).

    Raises:
        ValueError: as :func:`load_pool_state`.
    """
    saved = state["config"]
    limits = state["limits"]
    pool = pool_class(
        config,
        max_model_len=saved["max_model_len"],
        enable_caching=saved["enable_caching"],
        hash_algo=saved["hash_algo"],
        hash_seed=saved["hash_seed"],
        hash_block_size=saved["hash_block_size"],
        max_num_batched_tokens=limits["max_num_batched_tokens"],
        max_requests=limits["max_requests"],
        recently_freed=limits["recently_freed"],
        prefix_cache_retention_interval=saved.get("prefix_cache_retention_interval"),
        **kwargs,
    )
    load_pool_state(pool, state)
    return pool
