"""The Worker API messages the agent builds from its state, and the pool states it reads.

The agent's registration (config, layer specs, offered memory) and its allocation report
(the plan's block count, the tensors' bytes, identity and views) as ``kvsvc.v1`` messages,
so the agent's protocol code deals in its own objects.
"""

from __future__ import annotations

from kvsvc.convert import layer_specs_to_pb
from kvsvc.specs import KVCacheConfig, KVCacheSpec
from kvsvc.v1 import pools_pb2, worker_pb2
from kvsvc.worker.agent_config import WorkerAgentConfig
from kvsvc.worker.allocation import describe_views
from kvsvc.worker.allocators import KVCacheAllocation
from kvsvc.worker.profiling import MemoryProfile


def pool_state_name(state: int) -> str:
    """A pool state as the logs and ``WorkerAgent.state`` say it (``READY``, ``DEGRADED``)."""
    try:
        return pools_pb2.PoolState.Name(state).removeprefix("POOL_STATE_")  # type: ignore[arg-type]
    except ValueError:
        return str(state)


def register_request(
    config: WorkerAgentConfig,
    device: str,
    layer_specs: dict[str, KVCacheSpec],
    profile: MemoryProfile,
) -> worker_pb2.RegisterRequest:
    """This rank's registration: who it is, its layers and the memory it offers."""
    return worker_pb2.RegisterRequest(
        pool=config.pool,
        rank=config.rank,
        world_size=config.world_size,
        device=device,
        hostname=config.hostname,
        layers=layer_specs_to_pb(layer_specs),
        memory=worker_pb2.MemoryProfile(
            total_bytes=profile.total_bytes,
            free_bytes=profile.free_bytes,
            non_kv_bytes=profile.non_kv_bytes,
            kv_cache_bytes=profile.kv_cache_bytes,
        ),
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        max_model_len=config.max_model_len,
        max_num_encoder_input_tokens=config.max_num_encoder_input_tokens,
        model=config.model,
        in_engine=config.in_engine,
    )


def report_request(
    config: WorkerAgentConfig,
    session_id: str,
    plan: KVCacheConfig,
    allocation: KVCacheAllocation,
    memory_free_bytes: int,
) -> worker_pb2.ReportAllocationRequest:
    """The report of the tensors held for ``plan``, with a view per planned layer."""
    return worker_pb2.ReportAllocationRequest(
        pool=config.pool,
        rank=config.rank,
        session_id=session_id,
        num_blocks=plan.num_blocks,
        allocated_bytes=allocation.allocated_bytes,
        memory_free_bytes=memory_free_bytes,
        allocation_id=allocation.allocation_id,
        views=[
            worker_pb2.AllocatedView(
                layer_name=info.layer_name,
                shape=info.shape,
                stride=info.stride,
                dtype=info.dtype,
            )
            for info in describe_views(allocation.views, plan.layer_names)
        ],
    )


__all__ = ["pool_state_name", "register_request", "report_request"]
