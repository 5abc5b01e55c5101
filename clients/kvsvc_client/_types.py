"""Plain result and context types of the engine client (no protobuf in the public API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import grpc


class AllocateStatus(Enum):
    OK = "ok"
    # Not enough free blocks; nothing changed. Preempt something or wait.
    NO_SPACE = "no_space"
    # The request's KV data is gone (a rank came back with fresh memory, or a forced reset):
    # nothing changed. Free it as preempted and admit it again with its tokens so far.
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input's content hash and its placeholder tokens' position."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HashingContext:
    """Everything besides token ids that decides which cached blocks a prompt may reuse."""

    cache_salt: str = ""
    lora_name: str = ""
    lora_path: str = ""
    mm_items: tuple[MultiModalItem, ...] = ()
    # One digest of the prompt embeddings per full hash block.
    prompt_embeds_digests: tuple[bytes, ...] = ()
    # The adapter's integer id as the engine numbers it (0: none): reported in KV events,
    # never hashed.
    lora_id: int = 0


@dataclass(frozen=True, slots=True)
class RequestStart:
    """Marks a request's first Allocate (admission, or resumption after preemption)."""

    hashing: HashingContext | None = None
    skip_prefix_cache_read: bool = False
    resumed: bool = False
    num_encoder_tokens: int = 0
    # Of a resumed request's tokens, how many were its prompt (0: all of them).
    num_prompt_tokens: int = 0
    # At most this many leading tokens come from the prefix cache (None: all but the
    # last; 0: none, as skip_prefix_cache_read).
    max_cache_hit_tokens: int | None = None
    # Of num_new_tokens, draft slots beyond the tokens sent (scheduled on top of the
    # prompt's part: vLLM pads a resumed request with one token left to 1 + drafts).
    num_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AllocateResult:
    """The outcome of one allocation.

    Attributes:
        status: OK, or NO_SPACE (nothing changed).
        new_block_ids: per KV cache group, block ids appended to the request's table.
        num_null_blocks: per group, leading table entries that are now the null block.
        num_cached_tokens: tokens served from the prefix cache (first call).
        num_scheduled_tokens: tokens this call scheduled.
        num_computed_tokens: the request's computed tokens after this call.
    """

    status: AllocateStatus
    new_block_ids: tuple[tuple[int, ...], ...]
    num_null_blocks: tuple[int, ...]
    num_cached_tokens: int
    num_scheduled_tokens: int
    num_computed_tokens: int

    @property
    def ok(self) -> bool:
        return self.status is AllocateStatus.OK

    @property
    def needs_recompute(self) -> bool:
        """The request must be freed (preempted) and admitted again: its KV data is gone."""
        return self.status is AllocateStatus.RECOMPUTE


@dataclass(frozen=True, slots=True)
class FreeResult:
    num_freed_blocks: int


@dataclass(frozen=True, slots=True)
class OperationError:
    """A Step operation the server rejected (it changed nothing)."""

    code: grpc.StatusCode
    message: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A Step LOOKUP: the hit an admission of the prompt would get at that point of the batch.

    Attributes:
        num_cached_tokens: hit length in tokens (a multiple of the block size, at least
            one token left to compute).
        block_ids: per KV cache group, the hit blocks (the table an admission starts with).
    """

    num_cached_tokens: int
    block_ids: tuple[tuple[int, ...], ...]


StepOutcome = AllocateResult | FreeResult | LookupResult | OperationError


@dataclass(frozen=True, slots=True)
class BlockTable:
    groups: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_tokens: int
    # Its KV data is gone: allocations answer RECOMPUTE until it is freed.
    needs_recompute: bool = False


@dataclass(frozen=True, slots=True)
class Usage:
    pool: str
    num_blocks: int
    num_free_blocks: int
    usage: float
    num_requests: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preempted_queries: int
    preempted_hits: int
    num_evictions: int
    block_size: int
    kv_cache_capacity_tokens: int
    # Live requests (of num_requests) whose KV data is gone: they answer RECOMPUTE.
    num_requests_needing_recompute: int = 0
    # Times the pool's KV data was declared gone (forced resets, ranks with fresh tensors).
    num_invalidations: int = 0

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str
    medium: str
    group_index: int
    group_kind: str
    lora_id: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str
    group_index: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """A batch of prefix-index events, or a marker.

    Batches have ``sequence`` >= 1. Markers have ``sequence`` 0, no events, and
    ``oldest_available_sequence``, the sequence of the next batch: ``gap`` says the events
    before it were lost to this subscriber (rebuild what you derived from them),
    ``caught_up`` (only with ``watch_events(caught_up=True)``) that the replay reached the
    newest batch and what follows is new.
    """

    sequence: int
    timestamp: float
    events: tuple[KVEvent, ...]
    epoch: str
    gap: bool = False
    oldest_available_sequence: int = 0
    caught_up: bool = False


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One rank of a pool as the server sees it.

    Attributes:
        registered / allocated: an agent registered the rank / reported its tensors. Both
            stay set after the agent goes away (until it comes back or is replaced).
        connected: the agent holds its plan stream open now.
        live: connected and heartbeating within the pool's heartbeat timeout; a pool is
            READY only while every rank is live.
        in_engine: the rank's agent runs inside an engine (vLLM on kvsvc): restarting
            the engine brings it back.
    """

    rank: int
    device: str
    hostname: str
    registered: bool
    allocated: bool
    heartbeat_age_seconds: float
    kv_cache_bytes: int
    memory_free_bytes: int
    connected: bool = False
    live: bool = False
    in_engine: bool = False


@dataclass(frozen=True, slots=True)
class PoolInfo:
    name: str
    state: str
    world_size: int
    num_registered: int
    block_size: int
    num_blocks: int
    hash_algo: str
    enable_prefix_caching: bool
    error: str
    max_model_len: int
    workers: tuple[WorkerInfo, ...] = field(default_factory=tuple)
    # The pool's state epoch (the same across restarts that keep the state).
    epoch: str = ""
    # Its state is kept in a state directory (survives restarts).
    persistent: bool = False
    # Which sliding-window blocks the pool caches (vLLM's prefix_cache_retention_interval;
    # -1: every full block).
    prefix_cache_retention_interval: int = 0
