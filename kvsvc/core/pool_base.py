"""The state every part of a pool's facade shares, and its construction.

:class:`~kvsvc.core.pool.PoolKVCache` is the engine-facing facade; its parts live in
modules of their own (admission, the running-batch loop, the token bounds, the state as
plain values) and work on the pool's fields directly, as its methods do. They take this
class, which sits below all of them, so that no part imports the facade it serves: the
facade imports its parts, never the other way round. The compiled core keeps every field
access native either way (mypyc compiles the class hierarchy as one).
"""

from __future__ import annotations

from collections import OrderedDict

from kvsvc.core.events import MEDIUM_GPU
from kvsvc.core.manager import KVCacheManager
from kvsvc.core.pool_types import AdmissionRecord, AllocateOutcome
from kvsvc.core.request import RequestState
from kvsvc.specs import KVCacheConfig

# Freed request ids remembered per pool, so a retried Free succeeds (see PoolKVCache.free).
DEFAULT_RECENTLY_FREED = 65536


class PoolKVCacheBase:
    """A pool's fields, their checks at construction, its configuration read-outs and the
    answers several paths give alike. The arguments are
    :class:`~kvsvc.core.pool.PoolKVCache`'s (documented there)."""

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        max_model_len: int,
        enable_caching: bool = True,
        hash_algo: str = "xxh3_128",
        hash_seed: str | None = None,
        hash_block_size: int | None = None,
        max_num_batched_tokens: int = 8192,
        enable_events: bool = True,
        event_medium: str = MEDIUM_GPU,
        max_requests: int | None = None,
        recently_freed: int = DEFAULT_RECENTLY_FREED,
        max_tokens: int | None = None,
        max_unscheduled_tokens: int | None = None,
        prefix_cache_retention_interval: int | None = None,
        index_shards: int | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        if recently_freed < 0:
            raise ValueError(f"recently_freed must be >= 0, got {recently_freed}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if max_unscheduled_tokens is not None and max_unscheduled_tokens < 1:
            raise ValueError(f"max_unscheduled_tokens must be >= 1, got {max_unscheduled_tokens}")
        self.manager = KVCacheManager(
            config,
            max_model_len,
            enable_caching=enable_caching,
            hash_algo=hash_algo,
            hash_seed=hash_seed,
            hash_block_size=hash_block_size,
            enable_events=enable_events,
            medium=event_medium,
            prefix_cache_retention_interval=prefix_cache_retention_interval,
            index_shards=index_shards,
        )
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_requests = max_requests
        self.recently_freed = recently_freed
        self.max_tokens = max_tokens
        # Tokens of the live requests, together (what max_tokens bounds), and those of
        # them not computed yet (max_unscheduled_tokens).
        self.num_tokens_held = 0
        self.max_unscheduled_tokens = max_unscheduled_tokens
        self.num_tokens_unscheduled = 0
        self._requests: dict[str, RequestState] = {}
        # Live requests whose admission may still be retried (no successful call since).
        self._admissions: dict[str, AdmissionRecord] = {}
        # Freed ids, oldest first (values unused): a retried free of one is not an error.
        self._freed: OrderedDict[str, None] = OrderedDict()
        # Live requests whose KV data is gone (invalidate): every call but a free answers
        # ``recompute`` until the engine frees them.
        self._recompute: set[str] = set()
        self._num_preemptions = 0
        self.num_invalidations = 0
        coordinator = self.manager.coordinator
        # Groups that never drop blocks always report 0 leading nulls: skip asking.
        self._null_counts = (
            coordinator.num_leading_null_blocks if coordinator.may_drop_blocks else None
        )
        self._zeros: tuple[int, ...] = (0,) * self.num_groups

    # -- configuration -------------------------------------------------------------------

    @property
    def hash_seed(self) -> str:
        """The seed in use (random hex for xxh3 unless configured): persist it with the index."""
        return self.manager.hash_seed

    @property
    def hash_algo(self) -> str:
        return self.manager.hash_algo

    @property
    def enable_caching(self) -> bool:
        """Whether prefix caching is on (False when asked off or a group cannot be cached)."""
        return self.manager.enable_caching

    @property
    def num_groups(self) -> int:
        return self.manager.num_kv_cache_groups

    @property
    def group_kinds(self) -> list[str]:
        return list(self.manager.group_kinds)

    @property
    def block_size(self) -> int:
        """Scheduler block size: the lcm of the groups' block sizes."""
        return self.manager.block_size

    @property
    def hash_block_size(self) -> int:
        return self.manager.hash_block_size

    @property
    def has_plain_tables(self) -> bool:
        """One full-attention group: tables only grow (see :meth:`allocate_running`)."""
        return self.manager._plain_group is not None

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.manager.block_pool.num_blocks - 1

    # -- shared by the facade's parts ------------------------------------------------------

    def _no_new_blocks(self) -> tuple[list[int], ...]:
        # Fresh lists: callers own what an outcome holds.
        return tuple([] for _ in range(self.num_groups))

    def _recompute_outcome(self, request: RequestState) -> AllocateOutcome:
        """The answer to any allocation of a request whose KV data is gone: nothing
        changes, the engine must free it and admit it again."""
        null_counts = self._null_counts
        return AllocateOutcome(
            False,
            self._no_new_blocks(),
            self._zeros if null_counts is None else null_counts(request.request_id),
            0,
            0,
            request.num_computed_tokens,
            recompute=True,
        )

    def _trim_freed(self) -> None:
        """Forget the oldest freed ids beyond :attr:`recently_freed` (after it shrank)."""
        while len(self._freed) > self.recently_freed:
            self._freed.popitem(last=False)
