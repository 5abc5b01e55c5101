"""The worker agent: register, receive the plan, allocate, report, heartbeat, reconnect.

One agent per rank speaks ``kvsvc.v1.WorkerService``::

    Register ──▶ WatchPlan (stream) ──▶ config ──▶ allocator ──▶ ReportAllocation
        ▲            │ state changes (READY, DEGRADED, ...) keep arriving
        │            ▼
        └── stream broke / session stale / heartbeat said reregister: back off, register again
    Heartbeat every ``heartbeat_interval`` from the first registration on (its own thread;
    during an outage it beats for the lost session, and its failures count)

Two threads do the work: the *control* thread (register, follow the plan stream, allocate,
report) and the *heartbeat* thread. Tensors outlive sessions: after a server restart the
agent registers again with the same specs, gets the same plan back and keeps its tensors.

The allocator is the one step an engine may replace (:mod:`kvsvc.worker.allocators`): by
default the agent allocates the plan's tensors and reshapes them per layer; an engine that
allocates its own KV cache passes an allocator that hands the engine's tensors over.

Errors split three ways:

- **fatal** (the server said no, or the plan cannot be used): ``INVALID_ARGUMENT``,
  ``UNAUTHENTICATED``, ``PERMISSION_DENIED``, ``UNIMPLEMENTED``; ``NOT_FOUND`` (unknown
  pool) and ``ALREADY_EXISTS`` (another live agent holds the rank) at the first
  registration; a planning error; a plan that cannot be laid out. The agent stops and
  :attr:`WorkerAgent.error` says why; :meth:`WorkerAgent.start` raises it.
- **stale session** (``NOT_FOUND`` / ``FAILED_PRECONDITION`` after registering, or a
  heartbeat answered ``reregister``): register again.
- **anything else** (``UNAVAILABLE``, deadlines, a stream the server closed): retry with
  capped exponential backoff and jitter, forever unless ``connect_timeout`` is set. The
  retry first reopens the lost session's plan stream (a server that only lost the
  connection still holds the session, and would refuse a second registration of the rank
  as ``ALREADY_EXISTS``); a server that forgot it answers ``NOT_FOUND`` and the agent
  registers anew.

At a re-registration ``ALREADY_EXISTS`` is retried too: the server may still hold this
agent's own previous session until it expires.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import grpc

from kvsvc.convert import config_from_pb
from kvsvc.errors import InvalidArgument
from kvsvc.specs import KVCacheConfig, KVCacheSpec
from kvsvc.tls import open_channel
from kvsvc.units import format_gib
from kvsvc.v1 import pools_pb2, worker_pb2, worker_pb2_grpc
from kvsvc.worker.agent_config import WorkerAgentConfig
from kvsvc.worker.agent_messages import pool_state_name, register_request, report_request
from kvsvc.worker.allocation import KVCacheView, parse_device
from kvsvc.worker.allocators import DeviceAllocator, KVCacheAllocation, KVCacheAllocator
from kvsvc.worker.errors import WorkerAgentError
from kvsvc.worker.layouts import DEFAULT_LAYOUT
from kvsvc.worker.metrics import AgentMetrics
from kvsvc.worker.profiling import (
    PYTHON_NAMES,
    CudaMemorySnapshot,
    MemoryProfile,
    SettingNames,
    device_free_bytes,
    profile_memory,
)
from kvsvc.worker.retries import (
    FATAL_CODES,
    STALE_SESSION_CODES,
    RetrySession,
    backoff_delay,
    rpc_summary,
)

logger = logging.getLogger("kvsvc.worker")


class WorkerAgent:
    """One rank's agent. See the module docstring for the protocol and error handling.

    The tensors come from its allocator (:mod:`kvsvc.worker.allocators`): a
    :class:`~kvsvc.worker.allocators.DeviceAllocator` built from the layout arguments, or
    an engine's own, which :meth:`wait_plan` tells what to allocate.

    Thread-safe: properties may be read from any thread while the agent runs.
    """

    def __init__(
        self,
        config: WorkerAgentConfig,
        layer_specs: Mapping[str, KVCacheSpec],
        *,
        attn_layouts: Mapping[str, str] | None = None,
        default_attn_layout: str = DEFAULT_LAYOUT,
        shared_layers: Mapping[str, str] | None = None,
        kernel_block_sizes: Mapping[str, int] | None = None,
        metrics: AgentMetrics | None = None,
        memory_baseline: CudaMemorySnapshot | None = None,
        memory_profile: MemoryProfile | None = None,
        setting_names: SettingNames = PYTHON_NAMES,
        allocator: KVCacheAllocator | None = None,
    ) -> None:
        """Validate everything that can be checked before talking to the server.

        Args:
            config: see :class:`WorkerAgentConfig`.
            layer_specs: the KV cache spec of every layer this rank holds (layers that share
                another layer's cache excluded: list them in ``shared_layers``).
            attn_layouts: layout name per attention layer (:mod:`kvsvc.worker.layouts`).
            default_attn_layout: the layout of attention layers not in ``attn_layouts``.
            shared_layers: ``{layer: target}`` for KV-sharing layers; they get the target's
                view.
            kernel_block_sizes: per layer, a kernel block size smaller than the plan's.
                These four lay out the default allocator's views, and only its.
            metrics: series to update (default: a fresh registry).
            memory_baseline: CUDA: the snapshot taken before the engine loaded weights.
            memory_profile: skip profiling and offer these figures.
            setting_names: how memory errors name the settings to change (default the
                ``WorkerAgentConfig`` fields; ``kvsvc worker`` passes its flags).
            allocator: turns each plan into the tensors reported (default: a
                :class:`~kvsvc.worker.allocators.DeviceAllocator` on ``config.device``); an
                engine that allocates its own KV cache passes one that hands them over.

        Raises:
            InvalidArgument: naming the bad field.
        """
        config.validate()
        if not layer_specs:
            raise InvalidArgument("layer_specs", "a rank must hold at least one layer")
        self._device = str(parse_device(config.device))
        if allocator is None:
            allocator = DeviceAllocator(
                self._device,
                layer_specs,
                attn_layouts=attn_layouts,
                default_attn_layout=default_attn_layout,
                shared_layers=shared_layers,
                kernel_block_sizes=kernel_block_sizes,
            )
        elif (
            attn_layouts
            or shared_layers
            or kernel_block_sizes
            or default_attn_layout != DEFAULT_LAYOUT
        ):
            raise InvalidArgument(
                "allocator",
                "an allocator of its own lays out its views: attn_layouts, "
                "default_attn_layout, shared_layers and kernel_block_sizes are the default "
                "allocator's",
            )
        self._cfg = config
        self._allocator = allocator
        self._layer_specs = dict(layer_specs)
        self.metrics = metrics or AgentMetrics(config.pool, config.rank, self._device)
        self._baseline = memory_baseline
        self._profile = memory_profile
        self._setting_names = setting_names
        self._metadata = (
            (("authorization", f"Bearer {config.auth_token}"),) if config.auth_token else None
        )
        self._rng = random.Random()

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._launched = False
        self._done = False
        self._ever_ready = False
        self._error: WorkerAgentError | None = None
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._threads: list[threading.Thread] = []
        self._calls: set[Any] = set()  # in-flight futures and the plan stream, to cancel
        self._watch_call: Any = None
        self._reregister_reason: str | None = None
        self._reregister_resumable = False
        self._had_session = False
        self._progress = False

        self._session_id: str | None = None
        self._resume_session: str | None = None  # a lost session the server may still hold
        self._reported_session: str | None = None
        self._state = pools_pb2.POOL_STATE_UNSPECIFIED
        self._num_registered = 0
        self._max_model_len = 0
        self._plan: KVCacheConfig | None = None  # the latest handed to the allocator
        self._config: KVCacheConfig | None = None  # the plan of the tensors held
        self._allocation: KVCacheAllocation | None = None

    # ------------------------------------------------------------------ public API

    def start(self, timeout: float | None = None) -> dict[str, KVCacheView]:
        """Profile, register, wait for the plan, allocate and report; return the views.

        Args:
            timeout: seconds to wait for the pool's plan (``None``: forever).

        Returns:
            ``{layer_name: tensor}`` (Mamba layers: a list of state tensors), including
            the shared layers.

        Raises:
            WorkerAgentError: the memory budget does not fit or the device cannot be
                profiled (codes ``MEMORY``, ``DEVICE``: the message names the
                ``WorkerAgentConfig`` field), the server rejected the agent, planning
                failed, or ``timeout`` passed; the agent is stopped.
        """
        self.launch()
        try:
            return self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def launch(self) -> None:
        """Profile memory and start the agent's threads without waiting (see :meth:`start`).

        Raises:
            WorkerAgentError: the memory budget does not fit, or the device cannot be
                profiled (codes ``MEMORY``, ``DEVICE``).
        """
        with self._lock:
            if self._launched:
                raise RuntimeError("the agent was already started")
            self._launched = True
        if self._profile is None:
            try:
                self._profile = profile_memory(
                    self._device,
                    kv_cache_memory=self._cfg.kv_cache_memory,
                    gpu_memory_utilization=self._cfg.gpu_memory_utilization,
                    baseline=self._baseline,
                    names=self._setting_names,
                )
            except InvalidArgument as exc:
                # The documented error of start(), worded for whoever configured the agent.
                code = "DEVICE" if exc.field == "device" else "MEMORY"
                with self._changed:
                    self._done = True
                    self._changed.notify_all()
                raise WorkerAgentError(code, str(exc)) from None
        profile = self._profile
        self.metrics.memory_total.set(profile.total_bytes)
        self.metrics.memory_free.set(profile.free_bytes)
        self.metrics.offered.set(profile.kv_cache_bytes)
        logger.info(
            "rank %d of pool %s on %s: offering %s GiB to the KV cache "
            "(total %s GiB, free %s GiB, non-KV %s GiB)",
            self._cfg.rank,
            self._cfg.pool,
            self._device,
            format_gib(profile.kv_cache_bytes),
            format_gib(profile.total_bytes),
            format_gib(profile.free_bytes),
            format_gib(profile.non_kv_bytes),
        )
        self._channel = open_channel(
            self._cfg.server,
            self._cfg.client_tls(),
            [
                ("grpc.initial_reconnect_backoff_ms", int(self._cfg.backoff_initial * 1000)),
                ("grpc.min_reconnect_backoff_ms", int(self._cfg.backoff_initial * 1000)),
                ("grpc.max_reconnect_backoff_ms", int(self._cfg.backoff_max * 1000)),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ],
        )
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        name = f"kvsvc-agent-{self._cfg.pool}-{self._cfg.rank}"
        self._threads = [
            threading.Thread(target=self._control_loop, name=name, daemon=True),
            threading.Thread(target=self._heartbeat_loop, name=f"{name}-heartbeat", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def wait_ready(self, timeout: float | None = None) -> dict[str, KVCacheView]:
        """Block until the first allocation was reported; return the views.

        Raises:
            WorkerAgentError: the agent stopped (``error`` says why) or ``timeout`` passed.
        """
        with self._changed:
            self._changed.wait_for(lambda: self._ever_ready or self._done, timeout)
            if self._ever_ready and self._allocation is not None:
                return dict(self._allocation.views)
            raise self._why_no_plan(timeout)

    def wait_plan(self, timeout: float | None = None) -> KVCacheConfig:
        """Block until the agent handed this rank's plan to its allocator; return the plan.

        An engine that allocates its own KV cache learns here what to allocate, while its
        allocator waits for the tensors (:mod:`kvsvc.worker.allocators`).

        Raises:
            WorkerAgentError: the agent stopped (``error`` says why: the server refused it,
                planning failed) or ``timeout`` passed (``code == "TIMEOUT"``).
        """
        with self._changed:
            self._changed.wait_for(lambda: self._plan is not None or self._done, timeout)
            if self._plan is not None:
                return self._plan
            raise self._why_no_plan(timeout)

    def _why_no_plan(self, timeout: float | None) -> WorkerAgentError:
        """Why a wait for the plan ended without one (called holding the lock)."""
        if self._error is not None:
            return self._error
        if self._done:
            return WorkerAgentError("STOPPED", "the agent was stopped before its plan arrived")
        return WorkerAgentError(
            "TIMEOUT",
            f"no plan for pool {self._cfg.pool!r} after {timeout} s (pool state "
            f"{pool_state_name(self._state)}, {self._num_registered}/{self._cfg.world_size} "
            "ranks registered)",
        )

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the agent stops (fatal error or :meth:`stop`); True if it did."""
        with self._changed:
            return self._changed.wait_for(lambda: self._done, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the threads, cancel calls in flight and close the channel.

        The tensors stay valid (the engine may still hold them); heartbeats stop, so the
        server marks the rank gone after its timeout.
        """
        self._stop.set()
        self._allocator.cancel()  # an allocator waiting for the engine's tensors gives up
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        if self._channel is not None:
            self._channel.close()
        with self._changed:
            self._done = True
            self._changed.notify_all()
        self.metrics.ready.set(0)

    def __enter__(self) -> WorkerAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def error(self) -> WorkerAgentError | None:
        """Why the agent stopped on its own (``None`` while it runs or after :meth:`stop`)."""
        with self._lock:
            return self._error

    @property
    def kv_caches(self) -> dict[str, KVCacheView] | None:
        with self._lock:
            return dict(self._allocation.views) if self._allocation is not None else None

    @property
    def raw_tensors(self) -> dict[str, Any] | None:
        with self._lock:
            allocation = self._allocation
            if allocation is None or allocation.raw_tensors is None:
                return None
            return dict(allocation.raw_tensors)

    @property
    def plan(self) -> KVCacheConfig | None:
        """The plan last handed to the allocator (``None`` until one arrived)."""
        with self._lock:
            return self._plan

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        """The plan of the tensors held (``None`` until the allocator returned them)."""
        with self._lock:
            return self._config

    @property
    def memory_profile(self) -> MemoryProfile | None:
        return self._profile

    @property
    def session_id(self) -> str | None:
        with self._lock:
            return self._session_id

    @property
    def state(self) -> str:
        """The pool state last heard (``READY``, ``DEGRADED``, ...)."""
        with self._lock:
            return pool_state_name(self._state)

    @property
    def ready(self) -> bool:
        """Whether the server accepted this rank's allocation in the current session."""
        with self._lock:
            return self._session_id is not None and self._reported_session == self._session_id

    @property
    def max_model_len(self) -> int:
        """The pool's resolved max_model_len (0 until the plan arrives)."""
        with self._lock:
            return self._max_model_len

    @property
    def allocated_bytes(self) -> int:
        with self._lock:
            return self._allocation.allocated_bytes if self._allocation is not None else 0

    # ------------------------------------------------------------------ calls

    def _unary(self, method: Any, request: Any) -> Any:
        """Call a unary method with the deadline and credentials; cancellable by stop()."""
        future = method.future(request, timeout=self._cfg.rpc_timeout, metadata=self._metadata)
        with self._lock:
            self._calls.add(future)
        try:
            if self._stop.is_set():
                future.cancel()
            return future.result()
        except grpc.FutureCancelledError:
            raise RetrySession("call cancelled") from None
        finally:
            with self._lock:
                self._calls.discard(future)

    def _free_bytes(self) -> int:
        try:
            return device_free_bytes(self._device)
        except Exception:  # a reading must never stop heartbeats
            logger.debug("reading free memory failed", exc_info=True)
            return 0

    # ------------------------------------------------------------------ control thread

    def _control_loop(self) -> None:
        attempt = 0
        outage_since: float | None = None
        try:
            while not self._stop.is_set():
                try:
                    self._session()
                    reason, resumable, immediate = "the server closed the plan stream", True, False
                except RetrySession as exc:
                    reason, resumable, immediate = str(exc), exc.resumable, exc.immediate
                self._end_session(resumable)
                if self._stop.is_set():
                    break
                if immediate:
                    logger.info("%s; registering again", reason)
                    continue
                now = time.monotonic()
                if self._progress:
                    attempt, outage_since, self._progress = 0, None, False
                outage_since = outage_since if outage_since is not None else now
                if (
                    self._cfg.connect_timeout is not None
                    and now - outage_since >= self._cfg.connect_timeout
                ):
                    raise WorkerAgentError(
                        "UNREACHABLE",
                        f"no session with {self._cfg.server} for {now - outage_since:.1f} s "
                        f"(connect timeout {self._cfg.connect_timeout} s): {reason}",
                    )
                delay = backoff_delay(
                    attempt, self._cfg.backoff_initial, self._cfg.backoff_max, self._rng
                )
                attempt += 1
                logger.warning("%s; reconnecting in %.2f s", reason, delay)
                self._stop.wait(delay)
        except WorkerAgentError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug: stop rather than spin
            logger.exception("worker agent control loop crashed")
            self._fail(WorkerAgentError("INTERNAL", f"agent crashed: {type(exc).__name__}: {exc}"))
        finally:
            with self._changed:
                self._done = True
                self._changed.notify_all()

    def _fail(self, error: WorkerAgentError) -> None:
        logger.error("worker agent stopping: %s", error)
        with self._changed:
            self._error = error
            self._changed.notify_all()
        self._stop.set()
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def _end_session(self, resumable: bool) -> None:
        # A session lost with the connection may still live on the server: the next attempt
        # reopens its stream first, and the heartbeat thread keeps beating for it (during an
        # outage its failures are what dashboards see; a live server keeps the session).
        with self._lock:
            if self._session_id is not None:
                self._resume_session = self._session_id if resumable else None
            self._session_id = None
            self._reported_session = None
        self.metrics.ready.set(0)

    def _session(self) -> None:
        """One session: resume the lost one or register, then follow the plan stream."""
        with self._changed:
            session_id = self._resume_session
            if session_id is not None:
                self._session_id = session_id
                self._reported_session = None
                self._reregister_reason = None
        resumed = session_id is not None
        if session_id is None:
            session_id = self._register()
        call = self._stub.WatchPlan(
            worker_pb2.WatchPlanRequest(
                pool=self._cfg.pool, rank=self._cfg.rank, session_id=session_id
            ),
            metadata=self._metadata,
        )
        with self._lock:
            self._calls.add(call)
            self._watch_call = call
            cancel_now = self._reregister_reason is not None or self._stop.is_set()
        try:
            if cancel_now:
                call.cancel()
            for message in call:
                if resumed and not self._progress:
                    self.metrics.reconnects.inc()
                    logger.info("resumed session %s with %s", session_id, self._cfg.server)
                self._progress = True
                self._on_plan_message(message, session_id)
        except grpc.RpcError as err:
            code, details = rpc_summary(err)
            if code == grpc.StatusCode.CANCELLED:
                with self._lock:
                    reason, resumable = self._reregister_reason, self._reregister_resumable
                raise RetrySession(
                    reason or "plan stream cancelled",
                    resumable=resumable,
                    immediate=reason is not None and not resumable,
                ) from None
            if code in STALE_SESSION_CODES:
                raise RetrySession(
                    f"session {session_id} is stale ({code.name}: {details})",
                    resumable=False,
                    immediate=resumed,  # only a resumed session: no register/stale loop
                ) from None
            if code in FATAL_CODES:
                raise WorkerAgentError(code.name, f"WatchPlan: {details}") from None
            raise RetrySession(f"plan stream broke ({code.name}: {details})") from None
        finally:
            call.cancel()
            with self._lock:
                self._calls.discard(call)
                self._watch_call = None

    def _register(self) -> str:
        assert self._profile is not None, "launch() profiles before registering"
        request = register_request(self._cfg, self._device, self._layer_specs, self._profile)
        with self._lock:
            self._reregister_reason = None
            if self._allocation is not None:
                request.allocation_id = self._allocation.allocation_id
        try:
            response = self._unary(self._stub.Register, request)
        except grpc.RpcError as err:
            code, details = rpc_summary(err)
            fatal = code in FATAL_CODES or (
                not self._had_session
                and code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS)
            )
            if fatal:
                raise WorkerAgentError(code.name, f"Register: {details}") from None
            raise RetrySession(f"Register failed ({code.name}: {details})") from None
        with self._changed:
            self._session_id = response.session_id
            self._resume_session = None
            self._reported_session = None
            self._state = response.state
            self._num_registered = response.num_registered
            self._changed.notify_all()
        if self._had_session:
            self.metrics.reconnects.inc()
        self._had_session = True
        logger.info(
            "registered rank %d with pool %s at %s (session %s, %d/%d ranks, state %s)",
            self._cfg.rank,
            self._cfg.pool,
            self._cfg.server,
            response.session_id,
            response.num_registered,
            self._cfg.world_size,
            pool_state_name(response.state),
        )
        return str(response.session_id)

    def _on_plan_message(self, message: Any, session_id: str) -> None:
        with self._changed:
            if message.state != self._state:
                logger.info("pool %s is %s", self._cfg.pool, pool_state_name(message.state))
            self._state = message.state
            if message.max_model_len:
                self._max_model_len = message.max_model_len
            self._changed.notify_all()
        if message.error:
            raise WorkerAgentError(
                "PLAN_FAILED", f"planning pool {self._cfg.pool!r} failed: {message.error}"
            )
        if not message.HasField("config"):
            return
        try:
            config = config_from_pb(message.config)
        except InvalidArgument as exc:
            raise WorkerAgentError(
                "INVALID_PLAN", f"the server sent a malformed plan: {exc}"
            ) from None
        with self._lock:
            done = self._reported_session == session_id and self._config == config
        if done:
            return
        self._apply_plan(config)
        self._report(session_id)

    def _check_plan_layers(self, config: KVCacheConfig) -> None:
        """A plan must cover exactly this rank's layers (else it is another rank's)."""
        planned, mine = set(config.layer_names), set(self._layer_specs)
        if planned != mine:
            raise WorkerAgentError(
                "INVALID_PLAN",
                f"the plan's layers differ from this rank's: missing {sorted(mine - planned)}, "
                f"unexpected {sorted(planned - mine)}",
            )

    def _apply_plan(self, config: KVCacheConfig) -> None:
        """Keep the tensors of the same plan; hand a new plan to the allocator."""
        with self._lock:
            held, current = self._allocation is not None, self._config
        if held and config == current:
            logger.info("the plan is unchanged: keeping the %d-block tensors", config.num_blocks)
            return
        if held and not self._cfg.allow_replan:
            raise WorkerAgentError("REPLANNED", self._allocator.replan_refusal)
        self._check_plan_layers(config)
        assert self._profile is not None, "launch() profiles before registering"
        with self._changed:  # let the old tensors go before allocating new ones
            self._allocation = None
            self._plan = config
            self._changed.notify_all()
        allocation = self._allocator.allocate(config, self._profile)
        if allocation is None:  # stop() cancelled the wait: end the session quietly
            raise RetrySession("stopped before the tensors were allocated", resumable=False)
        with self._lock:
            self._config, self._allocation = config, allocation
        self.metrics.tensor_bytes.set(allocation.allocated_bytes)
        self.metrics.num_blocks.set(config.num_blocks)

    def _report(self, session_id: str) -> None:
        with self._lock:
            config, allocation = self._config, self._allocation
        assert config is not None and allocation is not None
        total = allocation.allocated_bytes
        free = self._free_bytes()
        request = report_request(self._cfg, session_id, config, allocation, free)
        try:
            response = self._unary(self._stub.ReportAllocation, request)
        except grpc.RpcError as err:
            code, details = rpc_summary(err)
            if code in FATAL_CODES:
                raise WorkerAgentError(code.name, f"ReportAllocation: {details}") from None
            if code in STALE_SESSION_CODES:
                raise RetrySession(
                    f"session {session_id} is stale ({code.name}: {details})", resumable=False
                ) from None
            raise RetrySession(f"ReportAllocation failed ({code.name}: {details})") from None
        with self._changed:
            self._reported_session = session_id
            self._state = response.state
            self._ever_ready = True
            self._changed.notify_all()
        self.metrics.ready.set(1)
        self.metrics.memory_free.set(free)
        logger.info(
            "reported %d blocks (%s GiB) to pool %s; %s GiB left on %s; pool is %s",
            config.num_blocks,
            format_gib(total),
            self._cfg.pool,
            format_gib(free),
            self._device,
            pool_state_name(response.state),
        )

    # ------------------------------------------------------------------ heartbeat thread

    def _request_reregister(self, session_id: str, reason: str, *, resumable: bool) -> None:
        """End ``session_id``'s plan stream (the control thread then reconnects).

        ``resumable=False``: the server does not know the session any more, so it must not
        be resumed either.
        """
        with self._lock:
            if session_id == self._resume_session and not resumable:
                self._resume_session = None
            if session_id != self._session_id or self._reregister_reason is not None:
                return
            self._reregister_reason = reason
            self._reregister_resumable = resumable
            call = self._watch_call
        if call is not None:
            call.cancel()

    def _heartbeat_loop(self) -> None:
        failures = 0
        while not self._stop.wait(self._cfg.heartbeat_interval):
            with self._lock:
                session_id = self._session_id or self._resume_session
            if session_id is None:
                continue
            free = self._free_bytes()
            self.metrics.memory_free.set(free)
            request = worker_pb2.HeartbeatRequest(
                pool=self._cfg.pool,
                rank=self._cfg.rank,
                session_id=session_id,
                memory_free_bytes=free,
            )
            try:
                response = self._unary(self._stub.Heartbeat, request)
            except RetrySession:
                continue  # cancelled by stop()
            except grpc.RpcError as err:
                code, details = rpc_summary(err)
                self.metrics.heartbeat_failures.inc()
                failures += 1
                logger.debug("heartbeat failed (%s: %s)", code.name, details)
                if code in STALE_SESSION_CODES:
                    self._request_reregister(
                        session_id, f"heartbeat: session stale ({details})", resumable=False
                    )
                elif failures >= self._cfg.heartbeat_failures_before_reconnect:
                    self._request_reregister(
                        session_id,
                        f"{failures} heartbeats in a row failed ({code.name})",
                        resumable=True,
                    )
                continue
            failures = 0
            self.metrics.heartbeats.inc()
            with self._changed:
                self._state = response.state
                self._changed.notify_all()
            if response.reregister:
                self._request_reregister(
                    session_id, "the server asked this rank to re-register", resumable=False
                )


__all__ = ["WorkerAgent"]
