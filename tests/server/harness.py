"""Test harness: a real kvsvc server on loopback (own event-loop thread) and test agents.

``FakeRank`` speaks the real WorkerService protocol over gRPC but does not allocate
tensors (that is the worker agent's job, tested on its own and end to end with real
processes); it lets server tests drive registration, planning and readiness precisely.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from kvsvc.convert import config_from_pb, layer_specs_to_pb
from kvsvc.server.app import KvsvcServer
from kvsvc.server.config import PoolConfig, ServerConfig
from kvsvc.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from kvsvc.v1 import worker_pb2, worker_pb2_grpc


class ServerThread:
    """Runs a KvsvcServer on its own event loop in a daemon thread."""

    def __init__(self, config: ServerConfig, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = KvsvcServer(config, **kwargs)  # restore=[...] for a snapshot file
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self.server.start())
        self.port = self.server.port
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the server's loop (to read or poke pool state safely)."""

        async def wrapper() -> Any:
            return fn(*args)

        return self.call(wrapper())

    def stop(self) -> None:
        self.call(self.server.stop(grace=0.5))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@contextmanager
def running_server(*pools: PoolConfig, **server_kwargs: Any) -> Iterator[ServerThread]:
    config = ServerConfig(
        pools=pools or (PoolConfig(name="p", world_size=1, max_model_len=1024),),
        listen=server_kwargs.pop("listen", "127.0.0.1:0"),
        metrics_listen=server_kwargs.pop("metrics_listen", None),
        **server_kwargs,
    )
    thread = ServerThread(config)
    try:
        yield thread
    finally:
        thread.stop()


@contextmanager
def tidy_client(server: ServerThread, pool: str = "p") -> Iterator[Any]:
    """A typed client of ``pool`` that frees every request still live when the block ends,
    so tests sharing one server start from an empty pool."""
    from kvsvc_client import KVCacheClient

    with KVCacheClient(server.address, pool=pool) as client:
        yield client
        for rid in server.run(lambda: server.server.pools.by_name[pool].cache.request_ids()):
            client.free(rid)


def llama_like_specs(
    num_layers: int = 4, block_size: int = 16, num_kv_heads: int = 2, head_size: int = 64
) -> dict[str, KVCacheSpec]:
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype="float16"
    )
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(num_layers)}


def hybrid_specs(
    num_layers: int = 4, block_size: int = 16, window: int = 64
) -> dict[str, KVCacheSpec]:
    """Every other layer sliding-window (a Gemma-2-like pattern)."""
    out: dict[str, KVCacheSpec] = {}
    for i in range(num_layers):
        common = {"block_size": block_size, "num_kv_heads": 2, "head_size": 64, "dtype": "float16"}
        out[f"model.layers.{i}.self_attn.attn"] = (
            SlidingWindowSpec(sliding_window=window, **common)
            if i % 2 == 0
            else FullAttentionSpec(**common)
        )
    return out


class FakeRank:
    """One rank of a pool, driven step by step over the real WorkerService API."""

    def __init__(
        self,
        address: str,
        pool: str,
        rank: int,
        world_size: int,
        specs: dict[str, KVCacheSpec],
        kv_cache_bytes: int,
        *,
        max_model_len: int = 0,
        token: str | None = None,
        allocation_id: str = "",
        in_engine: bool = False,
    ) -> None:
        self.channel = grpc.insecure_channel(address)
        self.in_engine = in_engine
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.pool = pool
        self.rank = rank
        self.world_size = world_size
        self.specs = specs
        self.kv_cache_bytes = kv_cache_bytes
        self.max_model_len = max_model_len
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        # The identity of the "tensors" this rank holds ("" as an agent that gives none).
        self.allocation_id = allocation_id
        self.session_id = ""
        self.stream: Any = None
        self.config: Any = None

    def register(self) -> worker_pb2.RegisterResponse:
        response = self.stub.Register(
            worker_pb2.RegisterRequest(
                pool=self.pool,
                rank=self.rank,
                world_size=self.world_size,
                device="cpu",
                hostname="test",
                layers=layer_specs_to_pb(self.specs),
                memory=worker_pb2.MemoryProfile(
                    total_bytes=4 * self.kv_cache_bytes, kv_cache_bytes=self.kv_cache_bytes
                ),
                max_model_len=self.max_model_len,
                model="test-model",
                allocation_id=self.allocation_id,
                in_engine=self.in_engine,
            ),
            timeout=10,
            metadata=self.metadata,
        )
        self.session_id = response.session_id
        return response

    def open_stream(self) -> None:
        self.stream = self.stub.WatchPlan(
            worker_pb2.WatchPlanRequest(pool=self.pool, rank=self.rank, session_id=self.session_id),
            metadata=self.metadata,
        )

    def next_update(self) -> worker_pb2.WatchPlanResponse:
        return next(self.stream)

    def wait_for_config(self) -> worker_pb2.WatchPlanResponse:
        while True:
            update = self.next_update()
            if update.HasField("config") or update.error:
                if update.HasField("config"):
                    self.config = config_from_pb(update.config)
                return update

    def report(self, num_blocks: int | None = None) -> worker_pb2.ReportAllocationResponse:
        return self.stub.ReportAllocation(
            worker_pb2.ReportAllocationRequest(
                pool=self.pool,
                rank=self.rank,
                session_id=self.session_id,
                num_blocks=self.config.num_blocks if num_blocks is None else num_blocks,
                allocated_bytes=self.kv_cache_bytes,
                memory_free_bytes=self.kv_cache_bytes,
                allocation_id=self.allocation_id,
            ),
            timeout=10,
            metadata=self.metadata,
        )

    def heartbeat(self) -> worker_pb2.HeartbeatResponse:
        return self.stub.Heartbeat(
            worker_pb2.HeartbeatRequest(pool=self.pool, rank=self.rank, session_id=self.session_id),
            timeout=10,
            metadata=self.metadata,
        )

    def join(self) -> FakeRank:
        """Register, wait for the plan and report it allocated: this rank's whole part in
        making its pool READY (a pool of one rank is READY after it)."""
        self.register()
        self.open_stream()
        update = self.wait_for_config()
        assert not update.error, update.error
        self.report()
        return self

    def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        self.channel.close()


def bring_up(
    server: ServerThread,
    pool: str = "p",
    world_size: int = 1,
    specs: dict[str, KVCacheSpec] | None = None,
    kv_cache_bytes: int = 1 << 20,
    token: str | None = None,
    allocation_id: str = "",
) -> list[FakeRank]:
    """Register every rank, wait for the plans, report allocations: the pool is READY.

    ``allocation_id``: rank r reports tensors ``f"{allocation_id}-{r}"`` (none when "")."""
    ranks = [
        FakeRank(
            server.address,
            pool,
            r,
            world_size,
            specs or llama_like_specs(),
            kv_cache_bytes,
            token=token,
            allocation_id=f"{allocation_id}-{r}" if allocation_id else "",
        )
        for r in range(world_size)
    ]
    for rank in ranks:
        rank.register()
        rank.open_stream()
    for rank in ranks:
        update = rank.wait_for_config()
        assert not update.error, update.error
    for rank in ranks:
        rank.report()
    return ranks
