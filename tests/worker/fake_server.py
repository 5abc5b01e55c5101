"""A minimal in-test WorkerService: the protocol of worker.proto, the real planner, no pool.

Register -> (all ranks in) plan with :func:`kvsvc.planner.plan_kv_cache` -> WatchPlan streams
state and config -> ReportAllocation -> READY; Heartbeat answers ``reregister`` for unknown
sessions. Tests reach into :class:`FakeWorkerService` to inject failures and read what the
agents sent; :class:`FakeServer` starts and stops it on a fixed loopback port so a test can
"restart the server" and watch the agents come back.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from kvsvc.convert import config_to_pb, layer_specs_from_pb
from kvsvc.errors import PlanningError, quoted
from kvsvc.planner import PlannerOptions, plan_kv_cache
from kvsvc.specs import KVCacheConfig, KVCacheSpec
from kvsvc.v1 import pools_pb2, worker_pb2, worker_pb2_grpc

Planner = Callable[[list[dict[str, KVCacheSpec]], list[int], int], list[KVCacheConfig]]


def real_planner(
    specs: list[dict[str, KVCacheSpec]], memory: list[int], max_model_len: int
) -> list[KVCacheConfig]:
    options = PlannerOptions(max_model_len=max_model_len)
    return plan_kv_cache(specs, memory, options).worker_configs


class FakeWorkerService(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(
        self,
        pool: str = "p",
        world_size: int = 1,
        *,
        max_model_len: int | None = None,
        planner: Planner | None = None,
        token: str | None = None,
    ) -> None:
        self.pool = pool
        self.world_size = world_size
        self.max_model_len = max_model_len
        self.planner = planner or real_planner
        self.token = token
        self.cond = threading.Condition()
        self.sessions: dict[int, str] = {}
        self.specs: dict[int, dict[str, KVCacheSpec]] = {}
        self.memory: dict[int, int] = {}
        self.configs: list[KVCacheConfig] | None = None
        self.error = ""
        self.reported: set[int] = set()
        self.reports: dict[int, Any] = {}
        self.registrations: list[Any] = []
        self.heartbeats: dict[int, int] = {}
        self.report_error: tuple[grpc.StatusCode, str] | None = None
        self.stream_epoch = 0
        self.watch_calls: list[str] = []

    # -- controls ---------------------------------------------------------------

    def forget(self, rank: int) -> None:
        """Drop a rank's session (as a server that expired it); its stream stays open."""
        with self.cond:
            self.sessions.pop(rank, None)
            self.reported.discard(rank)
            self.cond.notify_all()

    def break_streams(self) -> None:
        """End every open plan stream with UNAVAILABLE, keeping the sessions (a lost link)."""
        with self.cond:
            self.stream_epoch += 1
            self.cond.notify_all()

    def replan(self, configs: list[KVCacheConfig]) -> None:
        with self.cond:
            self.configs = configs
            self.reported.clear()
            self.cond.notify_all()

    @property
    def state(self) -> int:
        if self.configs is None:
            return pools_pb2.POOL_STATE_WAITING_FOR_WORKERS
        if len(self.reported) == self.world_size:
            return pools_pb2.POOL_STATE_READY
        return pools_pb2.POOL_STATE_PLANNED

    # -- the protocol ---------------------------------------------------------------

    def _check_auth(self, context: Any) -> None:
        if self.token is None:
            return
        metadata = dict(context.invocation_metadata())
        if metadata.get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def _session(self, request: Any, context: Any) -> None:
        if self.sessions.get(request.rank) != request.session_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {quoted(request.session_id)}")

    def Register(self, request: Any, context: Any) -> Any:
        self._check_auth(context)
        if request.pool != self.pool:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown pool {quoted(request.pool)}")
        if request.world_size != self.world_size:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"world_size: pool {quoted(self.pool)} has {self.world_size} ranks",
            )
        with self.cond:
            if request.rank in self.sessions:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"rank {request.rank} is held by a live agent"
                )
            self.registrations.append(request)
            session = uuid.uuid4().hex
            self.sessions[request.rank] = session
            self.specs[request.rank] = layer_specs_from_pb(request.layers)
            self.memory[request.rank] = request.memory.kv_cache_bytes
            if self.configs is None and len(self.sessions) == self.world_size:
                # Like the server: the pool's length, else the one the ranks report.
                if self.max_model_len is None:
                    self.max_model_len = request.max_model_len or 256
                try:
                    ranks = range(self.world_size)
                    self.configs = self.planner(
                        [self.specs[r] for r in ranks],
                        [self.memory[r] for r in ranks],
                        self.max_model_len,
                    )
                    self.error = ""
                except PlanningError as exc:
                    self.error = str(exc)
            self.cond.notify_all()
            return worker_pb2.RegisterResponse(
                session_id=session, state=self.state, num_registered=len(self.sessions)
            )

    def WatchPlan(self, request: Any, context: Any) -> Any:
        self._check_auth(context)
        with self.cond:
            self._session(request, context)
            self.watch_calls.append(request.session_id)
            epoch = self.stream_epoch
        last = None
        while context.is_active():
            with self.cond:
                if self.stream_epoch != epoch:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
                message = worker_pb2.WatchPlanResponse(
                    state=self.state, error=self.error, max_model_len=self.max_model_len or 0
                )
                if self.configs is not None:
                    message.config.CopyFrom(config_to_pb(self.configs[request.rank]))
                if message == last:
                    self.cond.wait(timeout=0.05)
                    continue
            last = message
            yield message

    def ReportAllocation(self, request: Any, context: Any) -> Any:
        self._check_auth(context)
        with self.cond:
            self._session(request, context)
            if self.report_error is not None:
                context.abort(*self.report_error)
            if self.configs is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no plan yet")
            planned = self.configs[request.rank].num_blocks
            if request.num_blocks != planned:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"num_blocks: {request.num_blocks} but the plan has {planned}",
                )
            self.reports[request.rank] = request
            self.reported.add(request.rank)
            self.cond.notify_all()
            return worker_pb2.ReportAllocationResponse(state=self.state)

    def Heartbeat(self, request: Any, context: Any) -> Any:
        self._check_auth(context)
        with self.cond:
            if self.sessions.get(request.rank) != request.session_id:
                return worker_pb2.HeartbeatResponse(state=self.state, reregister=True)
            self.heartbeats[request.rank] = self.heartbeats.get(request.rank, 0) + 1
            return worker_pb2.HeartbeatResponse(state=self.state)


class FakeServer:
    """The service on ``127.0.0.1:port`` (0: pick one); restartable on the same port."""

    def __init__(self, service: FakeWorkerService, port: int = 0) -> None:
        self.service = service
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(service, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        assert self.port, f"cannot bind 127.0.0.1:{port}"
        self._server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(grace=None).wait()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
