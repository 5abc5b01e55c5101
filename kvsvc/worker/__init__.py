"""The worker agent: profiles a device, receives its memory plan, allocates the KV cache.

This is the one kvsvc package that imports torch.

As a library, inside an engine's worker process (one agent per rank)::

    from kvsvc.worker import WorkerAgent, WorkerAgentConfig, take_cuda_snapshot

    baseline = take_cuda_snapshot()          # before loading weights (CUDA only)
    ...                                      # load the model, run the profile pass
    agent = WorkerAgent(
        WorkerAgentConfig(server="127.0.0.1:50051", pool="llama", rank=0, world_size=2,
                          device="cuda:0", gpu_memory_utilization=0.9),
        layer_specs={"model.layers.0.self_attn": FullAttentionSpec(...), ...},
        attn_layouts={"model.layers.0.self_attn": "flash"},   # default: "flash"
        shared_layers={"model.layers.5.self_attn": "model.layers.3.self_attn"},
        memory_baseline=baseline,
    )
    kv_caches = agent.start(timeout=300)     # {layer: tensor}, Mamba: {layer: [states]}
    ...                                      # bind kv_caches, serve
    agent.stop()

``start`` registers, waits until every rank of the pool registered and the server sent
this rank's plan, allocates and reshapes the tensors, reports them and returns the views;
a heartbeat thread then keeps the session alive and the agent re-registers on its own
when the server restarts (keeping the tensors: the same specs get the same plan). It
raises :class:`WorkerAgentError` when the memory budget does not fit, the server rejects
the rank or planning fails (the message says what to change). On a CPU-only machine skip
the snapshot (it raises ``InvalidArgument`` without CUDA) and give ``device="cpu"`` with a
fixed ``kv_cache_memory``. A different plan after ``start`` returned stops the agent
with ``REPLANNED`` (``agent.error``), since the engine bound the old tensors.

An engine that allocates its KV cache itself keeps the agent's protocol and replaces only
the allocation (:mod:`kvsvc.worker.allocators`)::

    tensors = EngineTensors("my-engine")
    agent = WorkerAgent(config, layer_specs, memory_profile=profile, allocator=tensors)
    agent.launch()
    plan = agent.wait_plan(timeout=300)      # the engine allocates plan.num_blocks blocks
    tensors.hand_over(engine_kv_caches, engine_kv_bytes)
    agent.wait_ready(timeout=60)             # reported; heartbeats until agent.stop()

Without gRPC, the pure steps::

    profile = profile_memory("cpu", kv_cache_memory=4 << 30)
    raw = allocate_kv_cache(config, "cpu")                 # {layer: raw int8 tensor}
    views = reshape_kv_cache(config, raw, layouts={"l0": "kv_first"},
                             shared_layers={"l5": "l3"})

As a process: ``kvsvc worker --server HOST:PORT --pool P --rank R --world-size W ...``
(:mod:`kvsvc.commands.worker`).
"""

from kvsvc.worker.agent import WorkerAgent
from kvsvc.worker.agent_config import WorkerAgentConfig
from kvsvc.worker.allocation import (
    KVCacheView,
    ViewInfo,
    allocate_kv_cache,
    allocated_bytes,
    describe_views,
    parse_device,
    reshape_kv_cache,
    torch_dtype,
)
from kvsvc.worker.allocators import (
    DeviceAllocator,
    EngineTensors,
    KVCacheAllocation,
    KVCacheAllocator,
)
from kvsvc.worker.errors import AllocationError, WorkerAgentError
from kvsvc.worker.layouts import DEFAULT_LAYOUT, LAYOUTS, AttentionLayout, resolve_layouts
from kvsvc.worker.metrics import AgentMetrics, MetricsServer, serve_metrics
from kvsvc.worker.profiling import (
    CudaMemorySnapshot,
    MemoryProfile,
    cpu_kv_cache_budget,
    cuda_kv_cache_budget,
    profile_memory,
    read_meminfo,
    take_cuda_snapshot,
)
from kvsvc.worker.retries import backoff_delay

__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "AgentMetrics",
    "AllocationError",
    "AttentionLayout",
    "CudaMemorySnapshot",
    "DeviceAllocator",
    "EngineTensors",
    "KVCacheAllocation",
    "KVCacheAllocator",
    "KVCacheView",
    "MemoryProfile",
    "MetricsServer",
    "ViewInfo",
    "WorkerAgent",
    "WorkerAgentConfig",
    "WorkerAgentError",
    "allocate_kv_cache",
    "allocated_bytes",
    "backoff_delay",
    "cpu_kv_cache_budget",
    "cuda_kv_cache_budget",
    "describe_views",
    "parse_device",
    "profile_memory",
    "read_meminfo",
    "reshape_kv_cache",
    "resolve_layouts",
    "serve_metrics",
    "take_cuda_snapshot",
    "torch_dtype",
]
