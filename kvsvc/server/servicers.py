"""gRPC servicers: thin adapters from the wire to :class:`~kvsvc.server.pool.Pool`.

Each handler validates the shape of its message, converts it (``kvsvc.server.wire``,
``kvsvc.convert``), calls the pool, and converts back. Errors are raised as
:mod:`kvsvc.errors` and mapped to status codes by the decorators of
:mod:`kvsvc.server.errors`.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from time import perf_counter
from typing import Any, cast

from kvsvc.convert import config_to_pb, layer_specs_from_pb
from kvsvc.core import MAX_FREE_QUEUE_WALK
from kvsvc.core.managers import representative_spec
from kvsvc.core.seed import seed_fingerprint
from kvsvc.errors import InvalidArgument, NotFound, Unavailable, quoted
from kvsvc.server.calls import (
    AllocateCall,
    FreeCall,
    apply_allocate,
    apply_free,
    apply_step_call,
    check_call_id,
    decode_allocate,
    decode_free,
    decode_step,
    journal_units,
)
from kvsvc.server.errors import CallObserver, OpenStreams, rpc_handler, rpc_stream_handler
from kvsvc.server.handler_stages import STAGES, handler_stages
from kvsvc.server.namespace import (
    check_pool_allowed,
    current_engine,
    current_pools,
    scoped_request_id,
)
from kvsvc.server.persistence.records import JournalKind
from kvsvc.server.pool import Pool, PoolState
from kvsvc.server.registration import MemoryReport, Registration
from kvsvc.server.reply_early import early_reply
from kvsvc.server.wire import (
    StepColumns,
    check_request_id,
    hashing_from_pb,
    token_ids_of,
)
from kvsvc.specs import SlidingWindowSpec
from kvsvc.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    kvcache_pb2,
    kvcache_pb2_grpc,
    pools_pb2,
    worker_pb2,
    worker_pb2_grpc,
)

TOKEN_ID_LIMIT = 2**31
# Trailing metadata of every reply of a call that names a pool: the pool's state epoch.
EPOCH_METADATA = "kvsvc-epoch"
# Pieces of a streamed snapshot file (far below the message size bound).
SNAPSHOT_CHUNK_BYTES = 1 << 20
# SnapshotIndex: hashes per message by default and at most (32-byte hashes: 2 MiB), and
# how long it waits for the events its copy includes to be published (durable).
SNAPSHOT_INDEX_HASHES = 8192
MAX_SNAPSHOT_INDEX_HASHES = 65536
SNAPSHOT_INDEX_PUBLISH_WAIT_S = 30.0
# Above this much work (tokens + 64 per operation) a call runs in a worker thread so the
# event loop keeps serving other pools, health checks and streams meanwhile.
OFFLOAD_WORK_THRESHOLD = 200_000
# A Lookup hashes its prompt outside the pool's lock; above this many tokens in a thread
# (a few milliseconds of hashing), so the loop keeps serving the pool's writers meanwhile.
LOOKUP_OFFLOAD_TOKENS = 16_384
_ALLOCATE = kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE
_FREE = kvcache_pb2.STEP_OPERATION_TYPE_FREE
_PREEMPT = kvcache_pb2.STEP_OPERATION_TYPE_PREEMPT


def step_work(columns: StepColumns) -> int:
    """A Step's work in token units: its tokens, 64 per operation, and the free-queue
    page it reads (its ids, and the links it may walk to reach its offset, bounded by
    ``MAX_FREE_QUEUE_WALK``: a page never costs O(offset))."""
    work = len(columns.token_ids) + 64 * len(columns.types)
    if columns.free_queue_head_limit:
        work += columns.free_queue_head_limit + min(
            columns.free_queue_head_offset, MAX_FREE_QUEUE_WALK
        )
    return work


def _pb_state(state: PoolState) -> pools_pb2.PoolState:
    """The wire enum of a pool state (the values are the same by construction)."""
    return cast(pools_pb2.PoolState, state.value)


class Pools:
    """The pools a server serves, by name."""

    def __init__(self, pools: dict[str, Pool]) -> None:
        self.by_name = pools
        # The server's streaming calls in progress (its graceful stop ends them).
        self.streams = OpenStreams()

    def get(self, name: str) -> Pool:
        """The pool ``name``, for a call allowed to use it (every pool-naming call of every
        service resolves its pool here, so an engine token's pool scope holds on each)."""
        if name:
            check_pool_allowed(name)
        pool = self.by_name.get(name)
        if pool is None:
            if not name:
                raise InvalidArgument("pool", "must name a pool")
            known = ", ".join(sorted(self.by_name)) or "none"
            raise NotFound(f"unknown pool {quoted(name)} (pools: {known})")
        return pool


class _Base:
    def __init__(self, pools: Pools, observer: CallObserver) -> None:
        self._pools = pools
        self._observer = observer


def _check_token_ids(token_ids: Sequence[int], field: str) -> None:
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= TOKEN_ID_LIMIT):
        bad = next(t for t in token_ids if t < 0 or t >= TOKEN_ID_LIMIT)
        raise InvalidArgument(field, f"token id {bad} is outside [0, 2^31)")


def _epoch(context: Any, pool: Pool) -> None:
    """Every reply of a call that names a pool carries the pool's state epoch: an engine
    retrying through a restart can tell a server that kept its state (same epoch) from
    one that lost it."""
    context.set_trailing_metadata(((EPOCH_METADATA, pool.events.epoch),))


# Where _mutate adds each stage's seconds (kvsvc.server.handler_stages).
_DECODE, _APPLY, _REPLY, _EVENTS, _JOURNAL = (
    STAGES.index(stage) for stage in ("decode", "apply", "reply", "events", "journal")
)


async def _mutate(
    pool: Pool,
    kind: int,
    request: Any,
    work: int,
    fn: Any,
    *args: Any,
    started: float,
    stage_sums: list[float],
) -> Any:
    """Apply an engine call that may change the pool, as its one writer, and reply once
    the change is durable.

    ``fn(*args)`` returns the reply and whether the pool changed. A change is journaled
    (the request as it came, the reply's digest, the event batch it made) in the same
    critical section, so the journal's order is the order of the changes, and the reply
    waits for the commit (:meth:`Pool.durable`). A call whose ``call_id`` was seen is
    answered with the first attempt's reply, applied nothing again. Without a journal, a
    transport that can (frames) sends the reply as soon as the change is applied, ahead of
    the events' drain and the reply's keeping (:mod:`kvsvc.server.reply_early`).

    ``started`` is when the handler began (what it spent before this is its decoding);
    each stage's seconds are added to ``stage_sums`` (:mod:`kvsvc.server.handler_stages`).
    """
    stage_sums[_DECODE] += perf_counter() - started
    engine = current_engine.get()
    call_id = request.call_id
    if call_id:
        check_call_id(call_id)
    cancelled = False
    async with pool.lock:
        known = pool.calls.get(engine, call_id, kind) if call_id else None
        if known is not None:
            response, ticket = known
        else:
            applying = perf_counter()
            if work > OFFLOAD_WORK_THRESHOLD:
                # The thread applies the change whatever happens to this call: a caller
                # that goes away (deadline, cancel) must neither release the lock nor skip
                # the journal while it runs.
                future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
                while True:
                    try:
                        response, changed = await asyncio.shield(future)
                        break
                    except asyncio.CancelledError:
                        cancelled = True
                        if future.done():
                            response, changed = future.result()
                            break
            else:
                response, changed = fn(*args)
            applied = perf_counter()
            stage_sums[_APPLY] += applied - applying
            # Without a journal the reply may go out now, before the bookkeeping below
            # (see kvsvc.server.reply_early); the bytes written are the ones kept.
            send_now = early_reply.get() if pool.persistence is None else None
            reply = None
            replied = applied
            if send_now is not None:
                reply = send_now(response)
                replied = perf_counter()
                stage_sums[_REPLY] += replied - applied
            batches = pool.drain_events()
            drained = perf_counter()
            stage_sums[_EVENTS] += drained - replied
            ticket = 0
            # An event is a change, whatever ``changed`` says. Only a change is journaled
            # and kept for a retry: repeating a call that changed nothing applies it once.
            if (changed or batches) and (call_id or pool.persistence is not None):
                if reply is None:
                    reply = response.SerializeToString()
                if pool.persistence is not None:
                    ticket = pool.journal(
                        kind,
                        engine,
                        request.SerializeToString(),
                        reply,
                        batches,
                        journal_units(kind, request),
                    )
                if call_id:
                    pool.calls.put(engine, call_id, kind, reply, ticket)
                stage_sums[_JOURNAL] += perf_counter() - drained
    if cancelled:
        raise asyncio.CancelledError
    await pool.durable(ticket)
    return response


async def _off_loop(work: int, fn: Any, *args: Any) -> Any:
    """Run ``fn`` (which touches no pool state) inline when small, in a thread when large."""
    if work > LOOKUP_OFFLOAD_TOKENS:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    return fn(*args)


async def _read(pool: Pool, fn: Any, *args: Any) -> Any:
    """Run a brief side-effect-free ``fn`` between the pool's writers.

    Inline writers run whole between two awaits, so on the loop a read never sees one
    half done; a writer offloaded to a thread holds ``pool.lock`` while it runs, so the
    read takes the lock too, but only for its own few microseconds (no events to drain).
    """
    async with pool.lock:
        return fn(*args)


_ALLOCATE_STAGES = handler_stages().table("Allocate")
_FREE_STAGES = handler_stages().table("Free")
_STEP_STAGES = handler_stages().table("Step")


class KVCacheServicer(_Base, kvcache_pb2_grpc.KVCacheServiceServicer):
    def __init__(self, pools: Pools, observer: CallObserver, max_step_operations: int) -> None:
        super().__init__(pools, observer)
        self._max_step_operations = max_step_operations

    @rpc_handler("Allocate")
    async def Allocate(self, request: Any, context: Any) -> kvcache_pb2.AllocateResponse:
        started = perf_counter()
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        pool.ensure_writable()
        call = decode_allocate(request, current_engine.get())
        response: kvcache_pb2.AllocateResponse = await _mutate(
            pool,
            JournalKind.ALLOCATE,
            request,
            len(call.tokens),
            self._allocate_one,
            pool,
            call,
            started=started,
            stage_sums=_ALLOCATE_STAGES,
        )
        return response

    @staticmethod
    def _allocate_one(pool: Pool, call: AllocateCall) -> tuple[Any, bool]:
        response, changed, outcome = apply_allocate(pool.ensure_writable(), call)
        pool.counters.count_allocate(outcome)
        return response, changed

    @rpc_handler("Free")
    async def Free(self, request: Any, context: Any) -> kvcache_pb2.FreeResponse:
        started = perf_counter()
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        pool.ensure_writable()
        call = decode_free(request, current_engine.get())
        response: kvcache_pb2.FreeResponse = await _mutate(
            pool,
            JournalKind.FREE,
            request,
            len(call.ids),
            self._free,
            pool,
            call,
            started=started,
            stage_sums=_FREE_STAGES,
        )
        return response

    @staticmethod
    def _free(pool: Pool, call: FreeCall) -> tuple[Any, bool]:
        response, changed, freed = apply_free(pool.ensure_writable(), call)
        requests = response.num_freed_requests if call.needing_recompute else len(call.ids)
        pool.counters.count_free(requests, freed, call.preempted)
        return response, changed

    @rpc_handler("Step")
    async def Step(self, request: Any, context: Any) -> kvcache_pb2.StepResponse:
        started = perf_counter()
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        pool.ensure_writable()
        engine = current_engine.get()
        columns = decode_step(request, engine, self._max_step_operations)
        work = step_work(columns)
        response: kvcache_pb2.StepResponse = await _mutate(
            pool,
            JournalKind.STEP,
            request,
            work,
            self._apply_step,
            pool,
            columns,
            engine,
            started=started,
            stage_sums=_STEP_STAGES,
        )
        pool.counters.count_step(len(columns.types))
        return response

    @staticmethod
    def _apply_step(pool: Pool, columns: StepColumns, engine: str) -> tuple[Any, bool]:
        return apply_step_call(pool.ensure_writable(), columns, engine, pool.counters)

    @rpc_handler("Lookup")
    async def Lookup(self, request: Any, context: Any) -> kvcache_pb2.LookupResponse:
        """A side-effect-free read, so it never stalls the pool's writers: the prompt is
        bounded by max_model_len before it is decoded, hashed outside the pool's lock (in
        a thread when long), and only the brief index probe runs between writers. The
        answer is the one ``PoolKVCache.lookup`` gives at the moment of the probe."""
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        cache = pool.ensure_serving()
        if request.packed_token_ids:
            cache.check_lookup_length(len(request.packed_token_ids) // 4, "token_ids")
        else:
            cache.check_lookup_length(len(request.token_ids), "token_ids")
        hashing = hashing_from_pb(request.hashing, "hashing")
        prepared = await _off_loop(
            len(request.token_ids) + len(request.packed_token_ids) // 4,
            self._prepare_lookup,
            cache,
            request,
            hashing,
        )
        cached, _ = await _read(pool, cache.probe_lookup, prepared)
        pool.counters.count_lookup(cached)
        return kvcache_pb2.LookupResponse(num_cached_tokens=cached)

    @staticmethod
    def _prepare_lookup(cache: Any, request: Any, hashing: Any) -> Any:
        """Decode, check and hash a Lookup's prompt (pure: safe beside the writers)."""
        tokens = token_ids_of(
            request.token_ids, request.packed_token_ids, "token_ids", "packed_token_ids"
        )
        _check_token_ids(tokens, "token_ids")
        return cache.prepare_lookup(tokens, hashing)

    @rpc_handler("GetBlockTable")
    async def GetBlockTable(self, request: Any, context: Any) -> kvcache_pb2.GetBlockTableResponse:
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        cache = pool.ensure_serving()
        check_request_id(request.request_id)
        view = cache.block_table(scoped_request_id(request.request_id))
        return kvcache_pb2.GetBlockTableResponse(
            groups=[kvcache_pb2.BlockTable(block_ids=ids) for ids in view.groups],
            num_computed_tokens=view.num_computed_tokens,
            num_tokens=view.num_tokens,
            needs_recompute=view.needs_recompute,
        )

    @rpc_stream_handler("WatchEvents")
    async def WatchEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """Follow the pool's events. Each batch goes out as the bytes the pool's event log
        serialized once for all subscribers, written with ``context.write`` (the method is
        registered by
        :func:`kvsvc.server.transports.grpc_listener.kvcache_method_handlers`, whose
        serializer passes bytes through), so a write that never completes can be timed
        out (see :meth:`EventLog.serve`). Nothing is yielded."""
        pool = self._pools.get(request.pool)
        start = request.from_sequence if request.HasField("from_sequence") else None
        await pool.events.serve(
            context.write,
            start,
            request.epoch,
            peer=context.peer(),
            caught_up=request.send_caught_up,
        )
        return
        yield  # an async generator, as rpc_stream_handler wraps one

    @rpc_handler("GetUsage")
    async def GetUsage(self, request: Any, context: Any) -> kvcache_pb2.GetUsageResponse:
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        cache = pool.ensure_serving()
        usage = cache.usage()
        assert pool.plan is not None
        return kvcache_pb2.GetUsageResponse(
            pool=pool.name,
            num_blocks=usage.num_blocks,
            num_free_blocks=usage.num_free_blocks,
            usage=usage.usage,
            num_requests=usage.num_requests,
            num_requests_needing_recompute=usage.num_requests_needing_recompute,
            num_invalidations=usage.num_invalidations,
            num_cached_blocks=usage.num_cached_blocks,
            prefix_cache=kvcache_pb2.PrefixCacheStats(
                queries=usage.queries,
                hits=usage.hits,
                preempted_queries=usage.preempted_queries,
                preempted_hits=usage.preempted_hits,
                requests=usage.requests,
                preempted_requests=usage.preempted_requests,
            ),
            num_evictions=usage.num_evictions,
            num_allocated_blocks=usage.num_allocated_blocks,
            block_size=cache.block_size,
            kv_cache_capacity_tokens=pool.plan.kv_cache_tokens,
        )

    @rpc_handler("ResetPrefixCache")
    async def ResetPrefixCache(
        self, request: Any, context: Any
    ) -> kvcache_pb2.ResetPrefixCacheResponse:
        pool = self._pools.get(request.pool)
        _epoch(context, pool)
        pool.ensure_writable()
        async with pool.lock:
            reset = pool.ensure_writable().reset_prefix_cache()
            batches = pool.drain_events()
            ticket = pool.journal(JournalKind.RESET, "", b"", b"\x01", batches) if reset else 0
        await pool.durable(ticket)
        return kvcache_pb2.ResetPrefixCacheResponse(reset=reset)

    @rpc_stream_handler("SnapshotIndex")
    async def SnapshotIndex(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """The pool's prefix index and the event sequence it is current at.

        The hash -> block maps are copied in one critical section (a dict copy: ~20 ms
        per million cached blocks, the writers wait that long), then streamed outside it.
        The stream starts once the event log has published every batch the copy includes
        (on a persistent pool, once they are durable): a follower that resumes WatchEvents
        at sequence + 1 then misses nothing, and never holds a change a restart could
        take back."""
        pool = self._pools.get(request.pool)
        limit = request.max_hashes_per_message or SNAPSHOT_INDEX_HASHES
        if not 1 <= limit <= MAX_SNAPSHOT_INDEX_HASHES:
            raise InvalidArgument(
                "max_hashes_per_message", f"{limit} is outside [1, {MAX_SNAPSHOT_INDEX_HASHES}]"
            )
        cache = pool.ensure_serving()
        async with pool.lock:
            cache = pool.ensure_serving()
            manager = cache.manager
            sequence = manager.events.last_seq if manager.events is not None else 0
            epoch = pool.events.epoch
            block_pool = manager.block_pool
            groups = [
                (
                    group,
                    block_pool.cached_index(group),  # a copy
                    # NOTE: the duplicates' map is the block pool's own; read, not kept.
                    {h: len(d) for h, d in block_pool._dups[group].items()},
                )
                for group in range(block_pool.num_groups)
            ]
        # Batches up to `sequence` reach the event log once durable (at once in memory).
        deadline = asyncio.get_running_loop().time() + SNAPSHOT_INDEX_PUBLISH_WAIT_S
        while pool.events.epoch == epoch and pool.events.last_sequence < sequence:
            if asyncio.get_running_loop().time() > deadline:
                raise Unavailable(
                    f"pool {quoted(pool.name)}: its events up to {sequence} were not "
                    f"published within {SNAPSHOT_INDEX_PUBLISH_WAIT_S:.0f} s; retry"
                )
            await asyncio.sleep(0.005)
        specs = [g.kv_cache_spec for g in manager.kv_cache_config.kv_cache_groups]
        index_groups = []
        for i, (kind, spec) in enumerate(zip(manager.group_kinds, specs, strict=True)):
            # The window decides a sliding-window group's hit rule, which an index must
            # reproduce (a full-attention spec's own sliding_window does not: it hits as
            # full attention).
            rule = representative_spec(spec)
            window = rule.sliding_window if isinstance(rule, SlidingWindowSpec) else 0
            index_groups.append(
                kvcache_pb2.IndexGroup(
                    group_index=i,
                    group_kind=kind,
                    block_size=spec.block_size,
                    sliding_window=window,
                )
            )
        yield kvcache_pb2.SnapshotIndexResponse(
            epoch=epoch,
            sequence=sequence,
            groups=index_groups,
            hash_block_size=manager.hash_block_size,
            hash_algo=manager.hash_algo,
            medium=block_pool.medium,
            hash_seed_fingerprint=seed_fingerprint(manager.hash_seed),
            total_hashes=sum(len(index) for _, index, _ in groups),
            last=not any(index for _, index, _ in groups),
        )
        remaining = sum(1 for _, index, _ in groups if index)
        for group, index, dups in groups:
            if not index:
                continue
            remaining -= 1
            hashes = list(index)
            for start in range(0, len(hashes), limit):
                chunk = hashes[start : start + limit]
                yield kvcache_pb2.SnapshotIndexResponse(
                    group_index=group,
                    block_hashes=chunk,
                    block_counts=[1 + dups.get(h, 0) for h in chunk],
                    last=not remaining and start + limit >= len(hashes),
                )


class WorkerServicer(_Base, worker_pb2_grpc.WorkerServiceServicer):
    @rpc_handler("Register")
    async def Register(self, request: Any, context: Any) -> worker_pb2.RegisterResponse:
        pool = self._pools.get(request.pool)
        specs = layer_specs_from_pb(request.layers)
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "max_model_len",
            "max_num_encoder_input_tokens",
        ):
            if getattr(request, name) < 0:
                raise InvalidArgument(name, "must be >= 0")
        memory = request.memory
        registration = Registration(
            rank=request.rank,
            world_size=request.world_size,
            device=request.device,
            hostname=request.hostname,
            specs=specs,
            memory=MemoryReport(
                total_bytes=memory.total_bytes,
                free_bytes=memory.free_bytes,
                non_kv_bytes=memory.non_kv_bytes,
                kv_cache_bytes=memory.kv_cache_bytes,
            ),
            tensor_parallel_size=request.tensor_parallel_size or 1,
            pipeline_parallel_size=request.pipeline_parallel_size or 1,
            max_model_len=request.max_model_len,
            max_num_encoder_input_tokens=request.max_num_encoder_input_tokens,
            model=request.model,
            total_num_kv_heads=max(0, request.total_num_kv_heads),
            allocation_id=request.allocation_id,
            in_engine=request.in_engine,
        )
        slot = await pool.register(registration)
        return worker_pb2.RegisterResponse(
            session_id=slot.session_id, state=_pb_state(pool.state), num_registered=len(pool.slots)
        )

    @rpc_stream_handler("WatchPlan")
    async def WatchPlan(self, request: Any, context: Any) -> AsyncIterator[Any]:
        pool = self._pools.get(request.pool)
        converted: dict[int, Any] = {}
        async for snapshot in pool.watch_plan(request.rank, request.session_id):
            message = worker_pb2.WatchPlanResponse(
                state=_pb_state(snapshot.state),
                error=snapshot.error,
                max_model_len=snapshot.max_model_len,
            )
            if snapshot.config is not None:
                key = id(snapshot.config)
                if key not in converted:
                    converted = {key: config_to_pb(snapshot.config)}
                message.config.CopyFrom(converted[key])
            yield message

    @rpc_handler("ReportAllocation")
    async def ReportAllocation(
        self, request: Any, context: Any
    ) -> worker_pb2.ReportAllocationResponse:
        pool = self._pools.get(request.pool)
        state = await pool.report_allocation(
            request.rank,
            request.session_id,
            num_blocks=request.num_blocks,
            allocated_bytes=request.allocated_bytes,
            memory_free_bytes=request.memory_free_bytes,
            views=list(request.views),
            allocation_id=request.allocation_id,
        )
        return worker_pb2.ReportAllocationResponse(state=_pb_state(state))

    @rpc_handler("Heartbeat")
    async def Heartbeat(self, request: Any, context: Any) -> worker_pb2.HeartbeatResponse:
        pool = self._pools.get(request.pool)
        state = pool.heartbeat(request.rank, request.session_id, request.memory_free_bytes)
        if state is None:
            return worker_pb2.HeartbeatResponse(state=_pb_state(pool.state), reregister=True)
        return worker_pb2.HeartbeatResponse(state=_pb_state(state))


def pool_summary(pool: Pool, now: float) -> admin_pb2.PoolSummary:
    plan = pool.plan
    workers = []
    for rank in range(pool.config.world_size):
        slot = pool.slots.get(rank)
        if slot is None:
            workers.append(admin_pb2.WorkerStatus(rank=rank))
            continue
        reg = slot.registration
        workers.append(
            admin_pb2.WorkerStatus(
                rank=rank,
                device=reg.device,
                hostname=reg.hostname,
                registered=True,
                allocated=slot.allocated,
                heartbeat_age_seconds=max(0.0, now - slot.last_seen),
                kv_cache_bytes=slot.available_bytes,
                memory_free_bytes=slot.memory_free_bytes or reg.memory.free_bytes,
                allocated_bytes=slot.allocated_bytes,
                views=slot.views,
                connected=slot.open_streams > 0,
                live=pool.rank_live(slot, now),
                in_engine=reg.in_engine,
            )
        )
    return admin_pb2.PoolSummary(
        name=pool.name,
        state=_pb_state(pool.state),
        world_size=pool.config.world_size,
        num_registered=len(pool.slots),
        block_size=plan.block_size if plan is not None else (pool.config.block_size or 0),
        num_blocks=max(0, plan.num_blocks - 1) if plan is not None else 0,
        hash_algo=pool.config.hash_algo,
        enable_prefix_caching=pool.config.enable_prefix_caching,
        error=pool.error,
        workers=workers,
        max_model_len=plan.max_model_len if plan is not None else 0,
        epoch=pool.events.epoch,
        persistent=pool.persistence is not None,
        prefix_cache_retention_interval=pool.config.prefix_cache_retention_interval,
    )


def plan_json(pool: Pool) -> str:
    """The plan as ``kvsvc plan --json`` prints it, plus the pool's state (and error)."""
    data: dict[str, Any] = pool.plan.to_dict() if pool.plan is not None else {}
    data["pool"] = pool.name
    data["state"] = pool.state.name
    if pool.error:
        data["error"] = pool.error
    return json.dumps(data, sort_keys=False)


class AdminServicer(_Base, admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, pools: Pools, observer: CallObserver, clock: Any) -> None:
        super().__init__(pools, observer)
        self._clock = clock

    @rpc_handler("ListPools")
    async def ListPools(self, request: Any, context: Any) -> admin_pb2.ListPoolsResponse:
        now = self._clock()
        allowed = current_pools.get()  # an engine scoped to its pools sees those only
        return admin_pb2.ListPoolsResponse(
            pools=[
                pool_summary(p, now)
                for name, p in sorted(self._pools.by_name.items())
                if allowed is None or name in allowed
            ]
        )

    @rpc_handler("GetPlan")
    async def GetPlan(self, request: Any, context: Any) -> admin_pb2.GetPlanResponse:
        pool = self._pools.get(request.pool)
        response = admin_pb2.GetPlanResponse(
            pool=pool_summary(pool, self._clock()), plan_json=plan_json(pool)
        )
        if pool.plan is not None:
            response.worker_configs.extend(config_to_pb(c) for c in pool.plan.worker_configs)
        return response

    @rpc_handler("ForceResetPrefixCache")
    async def ForceResetPrefixCache(
        self, request: Any, context: Any
    ) -> admin_pb2.ForceResetPrefixCacheResponse:
        """Invalidate the pool: its prefix index goes at once, held blocks included, and
        its live requests answer RECOMPUTE until their engine frees and re-admits them."""
        pool = self._pools.get(request.pool)
        pool.ensure_writable()
        async with pool.lock:
            pool.ensure_writable()
            assert pool.cache is not None
            flagged = pool.cache.num_requests
            dropped = pool.cache.usage().num_cached_blocks
            ticket = pool.invalidate("an operator reset the prefix cache by force")
        await pool.durable(ticket)
        return admin_pb2.ForceResetPrefixCacheResponse(
            num_requests_flagged=flagged, num_cached_blocks_dropped=dropped
        )

    @rpc_stream_handler("SnapshotPool")
    async def SnapshotPool(self, request: Any, context: Any) -> AsyncIterator[Any]:
        """The pool's state as a snapshot file, streamed in pieces (written to a private
        temporary directory first, removed after)."""
        pool = self._pools.get(request.pool)
        loop = asyncio.get_running_loop()
        with tempfile.TemporaryDirectory(prefix="kvsvc-snapshot-") as tmp:
            path = Path(tmp) / f"{pool.name}.snapshot.db"
            try:
                await pool.export_snapshot(path)
            except (OSError, sqlite3.Error) as exc:
                raise Unavailable(
                    f"writing the snapshot of pool {quoted(pool.name)} failed: {exc}"
                ) from None
            total = path.stat().st_size
            with path.open("rb") as handle:
                sent = 0
                while True:
                    data = await loop.run_in_executor(None, handle.read, SNAPSHOT_CHUNK_BYTES)
                    yield admin_pb2.SnapshotPoolChunk(data=data, total_bytes=0 if sent else total)
                    sent += len(data)
                    if sent >= total:
                        return


__all__ = [
    "AdminServicer",
    "KVCacheServicer",
    "PoolState",
    "Pools",
    "WorkerServicer",
]
