"""Typed Python client of kvsvc's engine API, blocking and asyncio. Needs no torch.

Example::

    from kvsvc_client import KVCacheClient, RequestStart, HashingContext

    with KVCacheClient("127.0.0.1:50051", pool="llama") as kv:
        first = kv.allocate("req-1", prompt_ids, num_new_tokens=2048,
                            start=RequestStart(hashing=HashingContext(cache_salt="tenant-a")))
        step = kv.step()
        step.allocate("req-1", [sampled_token], 1)
        step.free("req-0")
        results = step.send()
"""

from kvsvc_client._common import STEP_SENDERS, ClientOptions, resolve_token
from kvsvc_client._types import (
    AllBlocksCleared,
    AllocateResult,
    AllocateStatus,
    BlockRemoved,
    BlockStored,
    BlockTable,
    EventBatch,
    FreeResult,
    HashingContext,
    KVEvent,
    LookupResult,
    MultiModalItem,
    OperationError,
    PoolInfo,
    RequestStart,
    StepOutcome,
    Usage,
    WorkerInfo,
)
from kvsvc_client._wire import StepResultList
from kvsvc_client.aio import AsyncKVCacheClient, AsyncStep
from kvsvc_client.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    KVCacheError,
    NotFoundError,
    NotReadyError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from kvsvc_client.sync import KVCacheClient, PipelinedStep, StepFuture, SyncStep

__all__ = [
    "STEP_SENDERS",
    "AllBlocksCleared",
    "AllocateResult",
    "AllocateStatus",
    "AlreadyExistsError",
    "AsyncKVCacheClient",
    "AsyncStep",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "ClientOptions",
    "EventBatch",
    "FreeResult",
    "HashingContext",
    "InvalidArgumentError",
    "KVCacheClient",
    "KVCacheError",
    "KVEvent",
    "LookupResult",
    "MultiModalItem",
    "NotFoundError",
    "NotReadyError",
    "OperationError",
    "PermissionDeniedError",
    "PipelinedStep",
    "PoolInfo",
    "RequestStart",
    "ResourceExhaustedError",
    "StepFuture",
    "StepOutcome",
    "StepResultList",
    "SyncStep",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
    "WorkerInfo",
    "resolve_token",
]
