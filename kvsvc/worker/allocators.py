"""The worker agent's allocation hook: how a rank's plan becomes the tensors it reports.

A :class:`~kvsvc.worker.agent.WorkerAgent` keeps the protocol (register, follow the plan
stream, report, heartbeat, reconnect) and hands every new plan to its allocator::

    plan ──▶ agent: the plan of the tensors held? keep them, report again
                    another plan once tensors exist? stop with REPLANNED (unless allow_replan)
                    the plan's layers are not this rank's? stop with INVALID_PLAN
             allocator.allocate(plan, offered) ──▶ KVCacheAllocation ──▶ ReportAllocation

:class:`DeviceAllocator`, the default, allocates the plan's raw tensors on the agent's
device and lays out the per-layer views (:mod:`kvsvc.worker.allocation`). An engine that
allocates its KV cache itself (vLLM's model runner does) passes
``WorkerAgent(..., allocator=EngineTensors(...))``: its :meth:`~EngineTensors.allocate`
waits until the engine, told the plan by
:meth:`WorkerAgent.wait_plan <kvsvc.worker.agent.WorkerAgent.wait_plan>`, hands over what it
allocated (:class:`kvsvc.integrations.vllm.worker.EngineTensorsAgent` does). Any other
source of tensors subclasses :class:`KVCacheAllocator`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvsvc.errors import InvalidArgument
from kvsvc.planner import allocated_bytes as planned_bytes
from kvsvc.specs import KVCacheConfig, KVCacheSpec
from kvsvc.units import format_gib
from kvsvc.worker.allocation import (
    KVCacheView,
    allocate_kv_cache,
    allocated_bytes,
    reshape_kv_cache,
)
from kvsvc.worker.errors import AllocationError, WorkerAgentError
from kvsvc.worker.layouts import DEFAULT_LAYOUT, resolve_layouts
from kvsvc.worker.profiling import MemoryProfile

logger = logging.getLogger("kvsvc.worker")


@dataclass(frozen=True, slots=True)
class KVCacheAllocation:
    """The tensors an allocator made (or was handed) for a plan, as the agent reports them.

    Attributes:
        views: ``{layer: tensor}`` (Mamba layers: a list of state tensors) for every
            planned layer and every layer sharing another's cache: what
            :meth:`WorkerAgent.start` returns and ``ReportAllocation`` describes.
        allocated_bytes: the bytes behind the views, aliased storage counted once.
        raw_tensors: the backing allocations, when the allocator made them (``None``: the
            engine holds its own).
        allocation_id: identifies these tensors: new with every allocation, the same across
            sessions, so a server that kept its state tells whether the rank's KV data
            survived a reconnect or a server restart. ``""`` gives no identity: the server
            then takes every report after the first for fresh tensors and drops the pool's
            cached KV data.
    """

    views: dict[str, KVCacheView]
    allocated_bytes: int
    raw_tensors: dict[str, torch.Tensor] | None = None
    allocation_id: str = ""


class KVCacheAllocator(ABC):
    """The step of a :class:`WorkerAgent` that turns a plan into tensors; an engine's hook.

    Thread safety: the agent calls :meth:`allocate` on its control thread only, one call at
    a time; :meth:`cancel` may come from any thread while :meth:`allocate` runs.

    Attributes:
        replan_refusal: the message of the ``REPLANNED`` error that stops the agent when the
            server sends another plan after :meth:`allocate` handed out tensors and the
            agent's config does not ``allow_replan``; it tells whoever bound the tensors
            what to restart.
    """

    replan_refusal: str = (
        "the server sent a different plan after the tensors were handed out; the engine "
        "must restart to bind new tensors"
    )

    @abstractmethod
    def allocate(self, plan: KVCacheConfig, offered: MemoryProfile) -> KVCacheAllocation | None:
        """Allocate, or wait for the engine to allocate, the tensors of ``plan``.

        Called for a plan whose layers are this rank's, when the agent holds no tensors: the
        first plan, or (``allow_replan``) a new one after the agent let the old tensors go.
        The agent follows no plan message while this runs; heartbeats go on.

        Args:
            plan: this rank's plan.
            offered: the memory this rank offered the pool; the plan fits in its
                ``kv_cache_bytes`` unless the server overrode the block count.

        Returns:
            The tensors to report, or ``None`` when :meth:`cancel` ended the wait (the agent
            is stopping).

        Raises:
            WorkerAgentError: the plan cannot be allocated; the agent stops with it.
        """

    def cancel(self) -> None:  # noqa: B027 - an allocator that never waits has nothing to end
        """Make a waiting :meth:`allocate` return ``None``: :meth:`WorkerAgent.stop` calls it."""


class DeviceAllocator(KVCacheAllocator):
    """The agent's own allocation: the plan's raw tensors on its device, viewed per layer.

    Every new plan gets a new ``allocation_id``.
    """

    def __init__(
        self,
        device: str,
        layer_specs: Mapping[str, KVCacheSpec],
        *,
        attn_layouts: Mapping[str, str] | None = None,
        default_attn_layout: str = DEFAULT_LAYOUT,
        shared_layers: Mapping[str, str] | None = None,
        kernel_block_sizes: Mapping[str, int] | None = None,
    ) -> None:
        """Check the layouts and shared layers against the rank's layers.

        Args:
            device: a parsed torch device name (``"cpu"``, ``"cuda:0"``).
            layer_specs / attn_layouts / default_attn_layout / shared_layers /
                kernel_block_sizes: as :class:`WorkerAgent` takes them.

        Raises:
            InvalidArgument: naming the bad layout or shared layer.
        """
        resolve_layouts(layer_specs, attn_layouts, default_attn_layout)
        shared = dict(shared_layers or {})
        for name, target in shared.items():
            if name in layer_specs:
                raise InvalidArgument(f"shared_layers[{name}]", "the layer also has its own spec")
            if target not in layer_specs:
                raise InvalidArgument(
                    f"shared_layers[{name}]", f"target {target!r} is not a layer of this rank"
                )
        self._device = device
        self._layouts = dict(attn_layouts or {})
        self._default_layout = default_attn_layout
        self._shared = shared
        self._kernel_block_sizes = dict(kernel_block_sizes or {})

    def allocate(self, plan: KVCacheConfig, offered: MemoryProfile) -> KVCacheAllocation:
        """Allocate the plan's raw tensors and reshape them into the per-layer views.

        Raises:
            WorkerAgentError: ``INVALID_PLAN`` when the plan needs more than this rank
                offered, ``ALLOCATION`` when it cannot be laid out or allocated.
        """
        needed = planned_bytes(plan)
        if needed > offered.kv_cache_bytes:
            raise WorkerAgentError(
                "INVALID_PLAN",
                f"the plan needs {needed} bytes but this rank offered {offered.kv_cache_bytes}",
            )
        started = time.perf_counter()
        try:
            raw = allocate_kv_cache(plan, self._device)
            views = reshape_kv_cache(
                plan,
                raw,
                layouts=self._layouts,
                default_layout=self._default_layout,
                shared_layers=self._shared,
                kernel_block_sizes=self._kernel_block_sizes,
            )
        except (AllocationError, InvalidArgument) as exc:
            raise WorkerAgentError("ALLOCATION", f"cannot lay out the plan: {exc}") from None
        except RuntimeError as exc:  # torch.OutOfMemoryError and allocator failures
            raise WorkerAgentError(
                "ALLOCATION", f"allocating {needed} bytes on {self._device} failed: {exc}"
            ) from None
        total = allocated_bytes(raw)
        logger.info(
            "allocated %d blocks x %d layers in %d tensors: %s GiB on %s in %.2f s%s",
            plan.num_blocks,
            len(plan.layer_names),
            len(plan.kv_cache_tensors),
            format_gib(total),
            self._device,
            time.perf_counter() - started,
            " (zeroed)" if plan.needs_kv_cache_zeroing else "",
        )
        return KVCacheAllocation(views, total, raw_tensors=raw, allocation_id=uuid.uuid4().hex)


class EngineTensors(KVCacheAllocator):
    """For an engine that allocates its KV cache itself: the engine hands its tensors over.

    :meth:`allocate` waits on the agent's control thread until the engine, having allocated
    for the plan :meth:`WorkerAgent.wait_plan` returned, calls :meth:`hand_over` (or the
    agent stops). Tensors handed over are the engine's for good: the agent re-reports them
    after a reconnect, and another plan stops it with ``REPLANNED``.
    """

    def __init__(self, engine: str = "the engine") -> None:
        """``engine`` names the engine in the ``REPLANNED`` errors (``"vLLM"``)."""
        self._engine = engine
        self.replan_refusal = (
            f"the server sent a different plan after {engine} allocated its KV cache; "
            "restart the engine to allocate the new one"
        )
        self._handed = threading.Condition()
        self._plan: KVCacheConfig | None = None
        self._tensors: KVCacheAllocation | None = None
        self._cancelled = False

    def allocate(self, plan: KVCacheConfig, offered: MemoryProfile) -> KVCacheAllocation | None:
        """Wait for the engine's tensors for ``plan`` (``None``: the agent stopped first).

        Raises:
            WorkerAgentError: ``REPLANNED`` for a plan other than the one the engine is
                allocating for.
        """
        with self._handed:
            if self._plan is not None and plan != self._plan:
                raise WorkerAgentError(
                    "REPLANNED",
                    f"the server sent a different plan while {self._engine} was sizing its "
                    "KV cache from the first one; restart the engine",
                )
            self._plan = plan
            self._handed.wait_for(lambda: self._tensors is not None or self._cancelled)
            return self._tensors

    def cancel(self) -> None:
        with self._handed:
            self._cancelled = True
            self._handed.notify_all()

    def hand_over(self, views: Mapping[str, KVCacheView], allocated_bytes: int) -> None:
        """The tensors the engine bound for the plan, and the bytes behind them.

        ``views`` is informational for the server (``kvsvc ctl`` shows it). The tensors
        get an ``allocation_id`` of their own, minted here: they live as long as the engine
        process, so an agent that reconnects (a server restarted on its state) reports the
        same identity and the server keeps the pool's cached blocks, while a new engine
        process hands over new tensors with a new identity and the server drops them.
        """
        with self._handed:
            self._tensors = KVCacheAllocation(
                dict(views), allocated_bytes, allocation_id=uuid.uuid4().hex
            )
            self._handed.notify_all()


__all__ = ["DeviceAllocator", "EngineTensors", "KVCacheAllocation", "KVCacheAllocator"]
