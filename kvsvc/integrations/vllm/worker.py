"""vLLM's worker, sized by kvsvc: the pool's plan decides how many KV blocks vLLM allocates.

vLLM builds its workers from ``worker_cls`` (``vllm_kwargs`` names :class:`KvsvcWorker`),
so nothing of vLLM is patched. The engine core sizes the KV cache in three worker calls,
and this class hooks the two that matter::

    engine core                       KvsvcWorker (one per rank)              kvsvc server
    get_kv_cache_specs()  ───────▶  (vLLM's own)
    determine_available_memory() ─▶ vLLM's profiling (super)
                                    specs -> kvsvc specs, Register  ───────▶  pool waits for
                                    WatchPlan ◀──────────────────────────────  every rank, plans
                                    check the plan's block size / length
                                    return num_blocks x bytes per block,
                                    set num_gpu_blocks_override = num_blocks
    get_kv_cache_configs()          (vLLM's own sizing: yields the plan's num_blocks)
    initialize_from_config(cfg) ──▶ check cfg.num_blocks == the plan's
                                    vLLM allocates (super)
                                    ReportAllocation  ──────────────────────▶  READY once every
                                    heartbeats until shutdown                  rank reported

Why ``determine_available_memory``: it is the one worker call the engine core makes
between learning the layer specs and sizing the cache, and its answer (bytes per rank) is
what vLLM turns into ``num_blocks`` as ``memory // bytes_per_block``. Returning exactly
``plan.num_blocks * bytes_per_block`` makes vLLM's own arithmetic land on the plan even when
the worker runs in its own process. Where the worker shares ``vllm_config`` with the engine
core (the in-process executor), ``num_gpu_blocks_override`` pins the count as well, so a
rounding difference cannot move it. ``initialize_from_config`` then proves it: vLLM's
``kv_cache_config.num_blocks`` must equal the plan's, or the worker refuses to run (the
scheduler would hand out block ids the pool does not have).

The kvsvc side of a rank is :class:`EngineTensorsAgent`: kvsvc's own worker agent
(registration, plan stream, reconnects, heartbeats) with one difference, the tensors are
the engine's. Every failure to get a plan (server down, unknown pool, planning error,
block sizes that disagree) surfaces as :class:`KvsvcWorkerError` naming kvsvc, the server
and what to change, within ``plan_timeout``.
"""

from __future__ import annotations

import logging
import re
import socket
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvsvc_client import resolve_token
from vllm.platforms import current_platform

from kvsvc.integrations.vllm import compat
from kvsvc.integrations.vllm.config import KvsvcSettings, settings_from_additional_config
from kvsvc.integrations.vllm.specs import kvsvc_specs_from_vllm
from kvsvc.planner import allocated_bytes as planned_bytes
from kvsvc.planner import pool_bytes_per_block
from kvsvc.specs import KVCacheConfig, KVCacheSpec
from kvsvc.worker.agent import WorkerAgent
from kvsvc.worker.agent_config import WorkerAgentConfig
from kvsvc.worker.allocation import KVCacheView
from kvsvc.worker.allocators import EngineTensors
from kvsvc.worker.errors import WorkerAgentError
from kvsvc.worker.profiling import MemoryProfile, process_rss_bytes, read_meminfo

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec as VllmKVCacheSpec
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker
elif current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

logger = logging.getLogger("kvsvc.integrations.vllm")

# The pool's block size as the server words its refusal of a layer ("... not a multiple of
# pool 'x''s block size 32").
_POOL_BLOCK_SIZE = re.compile(r"block size (\d+)\s*$")


class KvsvcWorkerError(RuntimeError):
    """A vLLM worker could not get (or use) its KV cache plan from kvsvc.

    The message names kvsvc, the server address and pool, and what to change.
    """


class EngineTensorsAgent(WorkerAgent):
    """kvsvc's worker agent for a rank whose KV cache tensors the engine allocates.

    :class:`WorkerAgent` allocates the plan's tensors itself when the plan arrives; vLLM
    instead allocates after its own sizing step, so this agent's allocator is
    :class:`~kvsvc.worker.allocators.EngineTensors`: the worker reads the plan
    (:meth:`wait_plan`) and, once vLLM allocated, hands over what it bound (:meth:`bind`).
    The agent then reports the allocation (the pool goes READY when every rank did) and,
    after a server restart or a lost session, registers again and re-reports the same
    tensors; a *different* plan after binding stops the agent with ``REPLANNED``, since the
    engine cannot swap its cache. Heartbeats run from :meth:`launch` until :meth:`stop`.
    """

    def __init__(
        self,
        config: WorkerAgentConfig,
        layer_specs: Mapping[str, KVCacheSpec],
        *,
        memory_profile: MemoryProfile,
    ) -> None:
        engine_tensors = EngineTensors("vLLM")
        super().__init__(
            config, layer_specs, memory_profile=memory_profile, allocator=engine_tensors
        )
        self._engine_tensors = engine_tensors

    def bind(self, views: Mapping[str, KVCacheView], allocated: int, timeout: float | None) -> None:
        """Hand over the engine's tensors for the published plan and wait for the report.

        Args:
            views: the per-layer caches the engine bound (informational for the server).
            allocated: bytes the engine allocated for the KV cache.
            timeout: seconds to wait until the server accepted the report.

        Raises:
            WorkerAgentError: the report was refused or not accepted within ``timeout``.
        """
        if self.plan is None:
            raise RuntimeError("bind() before the plan arrived")
        self._engine_tensors.hand_over(views, allocated)
        self.wait_ready(timeout)


def _kv_cache_views(worker: Any, layers: list[str]) -> tuple[dict[str, KVCacheView], int]:
    """The caches vLLM bound to each planned layer, and the bytes behind them.

    vLLM binds each attention layer's cache into the compilation config's static forward
    context; the views go to the server for ``kvsvc ctl`` only, so a layer without one is
    listed without tensors rather than stopping the engine.
    """
    import torch

    context = worker.compilation_config.static_forward_context
    views: dict[str, KVCacheView] = {}
    storages: dict[int, int] = {}
    for name in layers:
        entry = context.get(name)
        cache = getattr(entry, "kv_cache", None)
        if isinstance(cache, torch.Tensor):
            tensors = [cache]
            views[name] = cache
        elif isinstance(cache, list | tuple) and all(isinstance(t, torch.Tensor) for t in cache):
            tensors = list(cache)
            views[name] = tensors
        else:
            logger.debug("layer %s has no bound KV cache tensor to report", name)
            tensors = []
            views[name] = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return views, sum(storages.values())


def _vllm_allocated_bytes(kv_cache_config: VllmKVCacheConfig) -> int:
    """Bytes vLLM's config allocates: tensors with the same backing alias it."""
    return max((t.size for t in kv_cache_config.kv_cache_tensors), default=0)


class KvsvcWorker(_PlatformWorker):
    """The platform's vLLM worker (CPU or GPU), with its KV cache plan from a kvsvc pool.

    Registers as rank ``pp_rank * tp + tp_rank`` of world size ``tp * pp`` with this
    worker's device, layer specs and profiled memory; see the module docstring for how the
    plan reaches vLLM. The settings come from ``additional_config["kvsvc"]``
    (:func:`kvsvc.integrations.vllm.vllm_kwargs`).

    Attributes:
        kvsvc_settings: server, pool and timeouts.
        kvsvc_plan: this rank's plan (``None`` until ``determine_available_memory``).
        kvsvc_profiled_memory: what vLLM's profiling offered the KV cache (bytes).
        kvsvc_available_memory: what this worker told vLLM instead (bytes).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Fail at construction, before the model loads, when the settings are missing.
        self.kvsvc_settings: KvsvcSettings = settings_from_additional_config(
            self.vllm_config.additional_config
        )
        self.kvsvc_plan: KVCacheConfig | None = None
        self.kvsvc_profiled_memory: int | None = None
        self.kvsvc_available_memory: int | None = None
        self._kvsvc_agent: EngineTensorsAgent | None = None
        self._kvsvc_bound = False
        self._kvsvc_rank = 0

    # ------------------------------------------------------------------ vLLM hooks

    def determine_available_memory(self) -> int:
        """Profile as vLLM does, register with the pool, return the memory of its plan.

        Raises:
            KvsvcWorkerError: no plan within ``plan_timeout`` (server unreachable, pool
                unknown, planning failed), or a plan this vLLM cannot run (block size,
                max_model_len, more memory than profiled).
            UnsupportedSpecError: a layer kvsvc cannot plan.
        """
        if self.kvsvc_plan is not None and self.kvsvc_available_memory is not None:
            return self.kvsvc_available_memory  # asked again (e.g. a re-profile): same plan
        profiled = int(super().determine_available_memory())
        vllm_specs = self.get_kv_cache_spec()
        if not vllm_specs:
            raise KvsvcWorkerError(
                f"kvsvc: the model {self.model_config.model!r} has no KV cache layers, so "
                f"there is nothing for kvsvc pool {self.kvsvc_settings.pool!r} to plan; "
                "run it without kvsvc's worker_cls/scheduler_cls"
            )
        specs = kvsvc_specs_from_vllm(vllm_specs)
        self._kvsvc_rank, world_size = self._kvsvc_rank_and_world()
        agent = EngineTensorsAgent(
            self._agent_config(self._kvsvc_rank, world_size),
            specs,
            memory_profile=self._memory_profile(profiled),
        )
        agent.launch()
        try:
            plan = agent.wait_plan(self.kvsvc_settings.plan_timeout)
            self._check_plan(plan, vllm_specs, agent.max_model_len, profiled)
        except WorkerAgentError as exc:
            agent.stop()
            raise self._plan_failure(exc, agent.state) from None
        except BaseException:
            agent.stop()
            raise
        self._kvsvc_agent = agent
        weakref.finalize(self, agent.stop)
        self.kvsvc_plan = plan
        self.kvsvc_profiled_memory = profiled
        self.kvsvc_available_memory = plan.num_blocks * pool_bytes_per_block(plan.kv_cache_groups)
        override = self.cache_config.num_gpu_blocks_override
        if override is not None and override != plan.num_blocks:
            logger.warning(
                "num_gpu_blocks_override=%d replaced by kvsvc pool %r's plan of %d blocks "
                "(set --num-gpu-blocks-override on `kvsvc serve` instead)",
                override,
                self.kvsvc_settings.pool,
                plan.num_blocks,
            )
        self.cache_config.num_gpu_blocks_override = plan.num_blocks
        logger.info(
            "kvsvc pool %r planned %d blocks for rank %d (vLLM profiled %d bytes for the KV "
            "cache; the plan uses %d)",
            self.kvsvc_settings.pool,
            plan.num_blocks,
            self._kvsvc_rank,
            profiled,
            self.kvsvc_available_memory,
        )
        return self.kvsvc_available_memory

    def initialize_from_config(self, kv_cache_config: VllmKVCacheConfig) -> None:
        """Allocate as vLLM does after checking it sized the plan; report to the pool.

        Raises:
            KvsvcWorkerError: vLLM's block count is not the plan's, or the pool did not
                accept the report.
        """
        agent, plan = self._kvsvc_agent, self.kvsvc_plan
        settings = self.kvsvc_settings
        if agent is None or plan is None:
            raise KvsvcWorkerError(
                f"kvsvc: vLLM allocates its KV cache without having asked kvsvc pool "
                f"{settings.pool!r} at {settings.server} for a plan (determine_available_memory "
                "was skipped, e.g. by an elastic scale-up launch, which kvsvc does not support)"
            )
        if kv_cache_config.num_blocks != plan.num_blocks:
            vllm_bytes = _vllm_allocated_bytes(kv_cache_config)
            agent.stop()
            raise KvsvcWorkerError(
                f"kvsvc: vLLM sized rank {self._kvsvc_rank}'s KV cache to "
                f"{kv_cache_config.num_blocks} blocks but kvsvc pool {settings.pool!r} at "
                f"{settings.server} planned {plan.num_blocks}; the engine's scheduler would "
                "hand out blocks the pool does not have. vLLM's bytes per block: "
                f"{vllm_bytes // max(kv_cache_config.num_blocks, 1)}, kvsvc's: "
                f"{pool_bytes_per_block(plan.kv_cache_groups)} (if they differ, kvsvc does "
                "not model this layout; otherwise another rank offered less memory)"
            )
        super().initialize_from_config(kv_cache_config)
        if self._kvsvc_bound:
            return
        views, allocated = _kv_cache_views(self, plan.layer_names)
        allocated = allocated or _vllm_allocated_bytes(kv_cache_config)
        try:
            agent.bind(views, allocated, settings.plan_timeout)
        except WorkerAgentError as exc:
            agent.stop()
            raise KvsvcWorkerError(
                f"kvsvc: rank {self._kvsvc_rank} of pool {settings.pool!r} allocated its "
                f"{plan.num_blocks} blocks but the kvsvc server at {settings.server} did not "
                f"accept the report ({exc.code}: {exc})"
            ) from None
        self._kvsvc_bound = True
        logger.info(
            "rank %d reported %d blocks (%d bytes) to kvsvc pool %r at %s",
            self._kvsvc_rank,
            plan.num_blocks,
            allocated,
            settings.pool,
            settings.server,
        )

    def shutdown(self) -> None:
        """Stop heartbeating (the pool marks the rank gone), then vLLM's own shutdown."""
        self.kvsvc_stop()
        super().shutdown()

    # ------------------------------------------------------------------ kvsvc side

    @property
    def kvsvc_agent(self) -> EngineTensorsAgent | None:
        """The rank's agent (registration, plan stream, heartbeats), once registered."""
        return self._kvsvc_agent

    def kvsvc_stop(self) -> None:
        """End the rank's session with the pool: no more heartbeats or re-registration."""
        agent, self._kvsvc_agent = self._kvsvc_agent, None
        if agent is not None:
            agent.stop()

    def _kvsvc_rank_and_world(self) -> tuple[int, int]:
        """This worker's rank in the pool (``pp_rank * tp + tp_rank``) and the pool size."""
        parallel = self.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) > 1:
                raise KvsvcWorkerError(
                    f"kvsvc: {name}={getattr(parallel, name)} is not supported: kvsvc plans "
                    "tensor- and pipeline-parallel pools only"
                )
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        except AssertionError:  # groups not initialised: the executor's rank order
            tp_rank, pp_rank = self.rank % tp, (self.rank // tp) % pp
        return pp_rank * tp + tp_rank, tp * pp

    def _agent_config(self, rank: int, world_size: int) -> WorkerAgentConfig:
        settings = self.kvsvc_settings
        model = self.model_config
        is_encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        return WorkerAgentConfig(
            server=settings.server,
            pool=settings.pool,
            rank=rank,
            world_size=world_size,
            device=str(self.device),
            tensor_parallel_size=self.parallel_config.tensor_parallel_size,
            pipeline_parallel_size=self.parallel_config.pipeline_parallel_size,
            max_model_len=int(model.max_model_len),
            max_num_encoder_input_tokens=(
                int(self.scheduler_config.max_num_encoder_input_tokens) if is_encoder_decoder else 0
            ),
            model=str(model.model),
            rpc_timeout=min(settings.rpc_timeout, 60.0),  # the Worker API's longest deadline
            auth_token=resolve_token("agent", settings.auth_token),
            # No connect timeout: before the plan, plan_timeout bounds the wait; after it,
            # a server outage must not end the rank's session for good.
            connect_timeout=None,
            hostname=socket.gethostname(),
            tls_ca=settings.tls_ca,
            tls_cert=settings.tls_cert,
            tls_key=settings.tls_key,
            tls_server_name=settings.tls_server_name,
            in_engine=True,
        )

    def _memory_profile(self, kv_cache_bytes: int) -> MemoryProfile:
        """The figures registered with the pool; the server plans with kv_cache_bytes."""
        device = str(self.device)
        if device.startswith("cuda"):
            import torch

            free, total = torch.cuda.mem_get_info(self.device)
            requested = int(total * self.cache_config.gpu_memory_utilization)
            non_kv = max(0, requested - kv_cache_bytes)
        else:
            info = read_meminfo()
            total, free = info.get("MemTotal", 0), info.get("MemAvailable", 0)
            non_kv = process_rss_bytes()
        return MemoryProfile(
            total_bytes=int(total),
            free_bytes=int(free),
            non_kv_bytes=int(non_kv),
            kv_cache_bytes=kv_cache_bytes,
        )

    def _vllm_block_sizes(self, vllm_specs: Mapping[str, VllmKVCacheSpec]) -> dict[str, int]:
        """The block size vLLM's own grouping gives each layer (page unification may
        change a layer's), so the plan is compared with what vLLM would allocate."""
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

        own = {name: spec.block_size for name, spec in vllm_specs.items()}
        try:
            groups = compat.kv_cache_groups(self.vllm_config, dict(vllm_specs))
        except ImportError:
            raise  # a release kvsvc does not know where to ask: never guess
        except Exception:  # grouping fails later in the engine core, with vLLM's message
            logger.debug("vLLM's KV cache grouping failed; comparing spec block sizes")
            return own
        for group in groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                inner = (
                    spec.kv_cache_specs.get(name, spec)
                    if isinstance(spec, UniformTypeKVCacheSpecs)
                    else spec
                )
                own[name] = inner.block_size
        return own

    def _check_plan(
        self,
        plan: KVCacheConfig,
        vllm_specs: Mapping[str, VllmKVCacheSpec],
        plan_max_model_len: int,
        profiled: int,
    ) -> None:
        """Refuse a plan this vLLM cannot run, saying what to change."""
        settings = self.kvsvc_settings
        pool = f"kvsvc pool {settings.pool!r} at {settings.server}"
        for name, expected in self._vllm_block_sizes(vllm_specs).items():
            planned = plan.layer_spec(name).block_size
            if planned != expected:
                raise KvsvcWorkerError(
                    f"kvsvc: {pool} planned block size {planned} for layer {name}, but vLLM "
                    f"runs it with block size {expected}. Make them agree: start vLLM with "
                    f"--block-size {planned}, or the pool with `kvsvc serve --block-size "
                    f"{expected}`"
                )
        model = self.model_config
        mine = int(model.max_model_len)
        if (
            plan_max_model_len
            and plan_max_model_len < mine
            and getattr(model, "original_max_model_len", mine) != -1
        ):
            raise KvsvcWorkerError(
                f"kvsvc: {pool} was planned for max_model_len={plan_max_model_len} but vLLM "
                f"runs with max_model_len={mine}: start vLLM with --max-model-len "
                f"{plan_max_model_len}, or the pool with `kvsvc serve --max-model-len {mine}` "
                "(or without --max-model-len, to take vLLM's)"
            )
        needed = planned_bytes(plan)
        if needed > profiled:
            raise KvsvcWorkerError(
                f"kvsvc: {pool} planned {plan.num_blocks} blocks ({needed} bytes) for rank "
                f"{self._kvsvc_rank}, but vLLM profiled only {profiled} bytes for its KV "
                "cache: lower `kvsvc serve --num-gpu-blocks-override`, or give vLLM more "
                "memory (--gpu-memory-utilization / --kv-cache-memory-bytes)"
            )

    def _plan_failure(self, exc: WorkerAgentError, state: str) -> KvsvcWorkerError:
        """The agent's error, told from the vLLM user's side: what failed and what to do."""
        settings = self.kvsvc_settings
        who = f"rank {self._kvsvc_rank} of kvsvc pool {settings.pool!r}"
        server = f"the kvsvc server at {settings.server}"
        if exc.code == "TIMEOUT" and state == "UNSPECIFIED":
            return KvsvcWorkerError(
                f"kvsvc: {who} could not reach {server} within plan_timeout="
                f"{settings.plan_timeout} s. Is `kvsvc serve --listen {settings.server} "
                f"--pool {settings.pool}` running there?"
            )
        if exc.code == "TIMEOUT":
            return KvsvcWorkerError(
                f"kvsvc: {who} registered with {server} but got no plan within plan_timeout="
                f"{settings.plan_timeout} s ({exc}); the pool plans once every rank "
                f"registered: see `kvsvc ctl --server {settings.server} pools`"
            )
        if exc.code == "PLAN_FAILED":
            return KvsvcWorkerError(f"kvsvc: {server} could not plan {who}: {exc}")
        message = f"kvsvc: {server} refused {who} ({exc.code}: {exc})"
        if exc.code == "NOT_FOUND":
            message += f"; start the server with `--pool {settings.pool}`"
        elif "world size" in str(exc):
            parallel = self.parallel_config
            tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
            message += (
                f". vLLM runs {tp * pp} ranks (tensor_parallel_size={tp} x "
                f"pipeline_parallel_size={pp}): run the pool with `kvsvc serve --world-size "
                f"{tp * pp}`"
            )
        elif "block size" in str(exc):
            match = _POOL_BLOCK_SIZE.search(str(exc))
            theirs = match.group(1) if match else "the pool's"
            mine = self.cache_config.block_size
            message += (
                f". vLLM runs with block size {mine}: start vLLM with --block-size {theirs}, "
                f"or the pool with `kvsvc serve --block-size {mine}`"
            )
        return KvsvcWorkerError(message)


__all__ = ["EngineTensorsAgent", "KvsvcWorker", "KvsvcWorkerError"]
