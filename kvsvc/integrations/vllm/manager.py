"""vLLM's scheduler-side KV cache manager, answered by a replica of a kvsvc pool.

vLLM's scheduler asks its KV cache manager one question per running request per step
(``allocate_slots``: slots, or ``None`` to preempt) and one per admission
(``get_computed_blocks``: the cached prefix), and needs each answer at once. One RPC per
question would cost a round trip per request per step. So the engine runs a **replica**
of its pool: kvsvc's own core (:class:`kvsvc.core.PoolKVCache`, the code the server runs
for the pool), fed the same operations in the same order as the server:

* **The replica answers vLLM locally.** kvsvc's core is deterministic: given the same
  free-queue order, the same groups and the same operations, it hands out the same block
  ids, finds the same prefix hits, drops the same out-of-window blocks and frees in the
  same order as the server's copy. Every attention kind the core has (full attention,
  sliding window, chunked local attention, Mamba state, cross attention, the hybrid
  coordinators) is therefore served by one implementation, the core, not by a second
  prediction of it here.
* **The server stays the owner.** Every operation that changes the pool is queued and
  sent as one ``Step`` per scheduling step, without waiting. The reply is checked at the
  start of the next step against what the replica answered: each operation's status,
  block ids per group, prefix hit and null blocks, and the pool's free count. A restart of
  vLLM or a router reading the pool sees the server's real state. (With the settings'
  ``steps_per_call`` above 1, the operations of steps that admit nothing wait for a
  later step's ``Step``: fewer calls, the server's view up to that many steps behind.)
* **Hashes stay the server's secret.** The replica hashes with a seed of its own: which
  blocks hit depends on which prompts share prefixes, not on the hash values, so the
  replica needs neither the server's seed nor its hash algorithm.
* **Faults are preemptions.** When the server says a request must be recomputed (a rank
  came back with fresh tensors, or an operator reset the pool by force) or answers
  anything but what the replica predicted, the scheduler preempts its running requests
  (as vLLM preempts for lack of blocks), the pool's prefix cache is reset, and the
  replica is rebuilt from the server's free queue; the requests are recomputed and the
  engine goes on.

A pool serves one engine (its blocks are that engine's KV memory), and the replica starts
from an idle pool whose prefix cache it resets: what a pool cached was computed in another
engine's memory.

Engines that schedule ahead (vLLM's async scheduling) and speculate are served exactly:
allocations carry vLLM's in-flight tokens (a window's blocks are freed on the
processed-token basis, as vLLM frees them), and outputs that arrive after their slots go
to the server as ``cache`` operations that cache only what vLLM's ``cache_blocks`` caches.
Not supported (refused at start with a clear error): KV connectors (P/D disaggregation,
offloading), and EAGLE/MTP's trailing-block handling (see
:func:`kvsvc.integrations.vllm.scheduler.eagle_refusal`).
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvsvc_client import (
    ClientOptions,
    HashingContext,
    KVCacheClient,
    KVCacheError,
    PipelinedStep,
    RequestStart,
    StepFuture,
    StepResultList,
    SyncStep,
)

from kvsvc.core.pool import PoolKVCache
from kvsvc.core.pool_types import RequestStart as CoreRequestStart
from kvsvc.core.single_type_manager import CrossAttentionManager
from kvsvc.errors import KvsvcError as CoreError
from kvsvc.integrations.vllm.config import KvsvcSettings
from kvsvc.integrations.vllm.prediction import Prediction, as_predicted, describe_divergence
from kvsvc.integrations.vllm.request_hashing import core_hashing
from kvsvc.specs import KVCacheConfig, SlidingWindowSpec
from kvsvc.v1 import kvcache_pb2 as pb

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_ALLOCATE = pb.STEP_OPERATION_TYPE_ALLOCATE
_FREE = pb.STEP_OPERATION_TYPE_FREE
_PREEMPT = pb.STEP_OPERATION_TYPE_PREEMPT
_OK = pb.ALLOCATE_STATUS_OK
_NO_SPACE = pb.ALLOCATE_STATUS_NO_SPACE
_RECOMPUTE = pb.ALLOCATE_STATUS_RECOMPUTE
# The server's bound on free_queue_head_limit: a larger queue is read in pages.
_MAX_HEAD = 65536
# With steps_per_call > 1, held steps' operations go out once they reach this many (with
# the step that reached it): a held Step stays far under the server's default bound on a
# Step's operations (max_step_operations, 8192), whatever the engine's batch.
HELD_OPERATIONS_LIMIT = 1024
# ManagerStats' per-step and per-call figures keep this many (an engine steps ~100 times a
# second for days: the lists grew without bound before).
STATS_KEPT = 65536


class KvsvcError(RuntimeError):
    """kvsvc could not serve vLLM's KV cache manager (server unreachable, refused, or a
    reply that disagrees with the replica); the message names the server and pool."""


@dataclass
class ManagerStats:
    """What the manager cost its engine (for benchmarks and logs).

    Attributes:
        steps_sent: Step RPCs sent.
        sync_calls: RPCs the scheduler waited for while it scheduled (connect and resyncs).
        operations_sent: operations those Steps carried.
        seconds_waiting: time the scheduler waited on kvsvc's replies.
        rpcs_by_step: RPCs per scheduling step (the last :data:`STATS_KEPT` steps').
        steps_by_call: for each Step sent by a scheduling step or an idle engine's flush,
            how many steps' operations it carried (with ``steps_per_call`` 1, 1 for
            every step's; 0 for a flush of what came after the last step), the last
            :data:`STATS_KEPT`.
        resyncs: times the replica was rebuilt after the server invalidated the pool.
    """

    steps_sent: int = 0
    sync_calls: int = 0
    operations_sent: int = 0
    seconds_waiting: float = 0.0
    rpcs_by_step: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_KEPT))
    steps_by_call: deque[int] = field(default_factory=lambda: deque(maxlen=STATS_KEPT))
    resyncs: int = 0


class KvsvcPoolReplica:
    """The engine-side half of a kvsvc pool: a replica of the pool and the Step queue.

    vLLM-free (token lists and counts in, block ids out), so it is tested without vLLM;
    :class:`kvsvc.integrations.vllm.scheduler.KvsvcKVCacheManager` adapts vLLM's objects
    to it.

    Args:
        settings: the server and pool.
        config: the engine's KV cache groups as kvsvc specs (the scheduler's view: one
            spec per group) and its block count, null block included (must be the pool's).
        block_size: the engine's block size (must be the pool's).
        max_model_len: the engine's longest sequence.
        enable_caching: whether the engine caches prefixes (must match the pool).
        hash_block_size: the engine's hashing granularity (None: the core's default).
        prefix_cache_retention_interval: the engine's setting of that name (must match
            the pool's; None: every full block of a window group is cached).

    Raises:
        KvsvcError: the server is unreachable, the pool is another size, or the pool
            holds live requests of another engine.
    """

    def __init__(
        self,
        settings: KvsvcSettings,
        *,
        config: KVCacheConfig,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        hash_block_size: int | None = None,
        prefix_cache_retention_interval: int | None = 0,
    ) -> None:
        self.settings = settings
        self.pool = settings.pool
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.retention_interval = prefix_cache_retention_interval
        self.num_blocks = config.num_blocks
        self.num_groups = len(config.kv_cache_groups)
        self._where = f"kvsvc server {settings.engine_target} (pool {settings.pool!r})"
        self._client = KVCacheClient(
            settings.engine_target,
            settings.pool,
            options=ClientOptions(
                timeout=settings.rpc_timeout,
                unavailable_timeout=settings.unavailable_timeout,
                token=settings.auth_token,
                role="engine",
                tls_ca=settings.tls_ca,
                tls_cert=settings.tls_cert,
                tls_key=settings.tls_key,
                tls_server_name=settings.tls_server_name,
                step_sender=settings.step_sender,
            ),
        )
        # Tokens of each live request the server knows (prompt + outputs sent so far).
        self._num_sent: dict[str, int] = {}
        self.pending = self._client.step()
        self._prediction = Prediction()
        self._in_flight: tuple[StepFuture | PipelinedStep, Prediction, int] | None = None
        # Set when a reply showed the server invalidated the pool (or diverged): the
        # scheduler preempts its requests and calls resync() before it schedules again.
        self.needs_resync = False
        self._resync_reason = ""
        # The pool's invalidation count when the replica was built (see _check).
        self._invalidations_seen = 0
        self.stats = ManagerStats()
        self._step_rpcs = 0
        # Steps whose operations wait in ``pending`` for a later step's Step (at most
        # settings.steps_per_call - 1), and whether one of them admitted a request.
        self._steps_per_call = settings.steps_per_call
        self._steps_held = 0
        self._admitted = False
        self._closed = False
        self.cache: PoolKVCache = self._new_cache()
        self._connect()
        self._step_rpcs = 0  # start-up's calls are no scheduling step's

    # -- start ---------------------------------------------------------------------------

    def _new_cache(self) -> PoolKVCache:
        try:
            return PoolKVCache(
                self.config,
                max_model_len=self.max_model_len,
                enable_caching=self.enable_caching,
                hash_algo="xxh3_128",
                # The replica's own secret: hits depend on shared prefixes, not on values.
                hash_seed=secrets.token_hex(16),
                hash_block_size=self.hash_block_size,
                enable_events=False,
                recently_freed=0,
                prefix_cache_retention_interval=self.retention_interval,
            )
        except ValueError as exc:
            raise KvsvcError(
                f"{self._where}: cannot replicate the engine's KV cache: {exc}"
            ) from None

    def _connect(self) -> None:
        pools = self._call(self._client.list_pools, "list the server's pools")
        summary = next((p for p in pools if p.name == self.pool), None)
        if summary is None:
            names = ", ".join(p.name for p in pools) or "none"
            raise KvsvcError(f"{self._where}: no such pool (pools: {names})")
        if summary.block_size != self.block_size:
            raise KvsvcError(
                f"{self._where} uses block size {summary.block_size} but vLLM uses "
                f"{self.block_size}: give vLLM block_size={summary.block_size} or start the "
                f"pool with --block-size {self.block_size}"
            )
        if summary.enable_prefix_caching != self.enable_caching:
            raise KvsvcError(
                f"{self._where} has prefix caching "
                f"{'on' if summary.enable_prefix_caching else 'off'} but vLLM has it "
                f"{'on' if self.enable_caching else 'off'}: make them agree "
                "(kvsvc serve --no-prefix-caching / vLLM enable_prefix_caching)"
            )
        if summary.max_model_len and summary.max_model_len < self.max_model_len:
            raise KvsvcError(
                f"{self._where} admits at most {summary.max_model_len} tokens per request but "
                f"vLLM's max_model_len is {self.max_model_len}: lower vLLM's or raise the "
                "pool's --max-model-len"
            )
        retention = -1 if self.retention_interval is None else self.retention_interval
        if self._has_window_group() and summary.prefix_cache_retention_interval != retention:
            raise KvsvcError(
                f"{self._where} caches sliding-window blocks with "
                f"prefix_cache_retention_interval={summary.prefix_cache_retention_interval}"
                f" but vLLM uses {retention}: start the pool with "
                f"--prefix-cache-retention-interval {retention} (or give vLLM the pool's)"
            )
        usage = self._call(self._client.usage, "read the pool's usage")
        if usage.num_blocks != self.num_blocks - 1:
            raise KvsvcError(
                f"{self._where} has {usage.num_blocks} usable blocks but vLLM allocated "
                f"{self.num_blocks - 1}: run vLLM with kvsvc's worker "
                "(vllm_kwargs sets worker_cls) so it allocates the pool's plan"
            )
        if usage.num_requests and usage.num_requests_needing_recompute:
            # An engine of this pool died with requests live, and this engine's workers
            # took its ranks with fresh tensors: those requests' KV data went with the old
            # tensors, so nothing is left to resume them from. Free them (this engine's
            # namespace only); a live engine's requests are not flagged and stay.
            freed = self._call(self._client.free_needing_recompute, "free stale requests")
            if freed:
                logger.warning(
                    "%s: freed %d requests an earlier engine left live (their KV data went "
                    "with its tensors)",
                    self._where,
                    freed,
                )
            usage = self._call(self._client.usage, "read the pool's usage")
        if usage.num_requests:
            raise KvsvcError(
                f"{self._where} holds {usage.num_requests} live requests of another engine: "
                "a pool serves one engine (its blocks are that engine's KV memory): stop "
                "the other engine (a dead engine's requests are freed here once its ranks "
                "came back with fresh tensors)"
            )
        self._start_from_idle_pool(usage.num_invalidations)

    def _has_window_group(self) -> bool:
        return any(
            isinstance(group.kv_cache_spec, SlidingWindowSpec)
            for group in self.config.kv_cache_groups
        )

    def _start_from_idle_pool(self, num_invalidations: int) -> None:
        """Reset the (idle) pool's prefix cache and copy its free queue into a fresh replica.

        ``num_invalidations``: the pool's count as the caller's last usage read gave it;
        invalidations after it empty the prefix index behind the replica (see _check).

        A new engine's KV tensors hold nothing: whatever the pool cached was computed in
        another engine's memory and must not be served as a hit. With no request live and
        nothing cached, the free queue's order is the whole state of the pool.
        """
        self._invalidations_seen = num_invalidations
        if not self._call(self._client.reset_prefix_cache, "reset the prefix cache"):
            raise KvsvcError(
                f"{self._where} refused to reset its prefix cache: a request still holds "
                "blocks (another engine uses the pool)"
            )
        order: list[int] = []
        while True:
            step = self._client.step()
            step.free_queue_head_limit = _MAX_HEAD
            step.free_queue_head_offset = len(order)
            results = self._sync(step, "read the pool's free queue")
            page = results.free_queue_head
            order.extend(page)
            if len(page) < _MAX_HEAD:
                break
        if len(order) != results.num_free_blocks or len(order) != self.num_blocks - 1:
            raise KvsvcError(
                f"{self._where}: the pool's free queue holds {len(order)} of "
                f"{self.num_blocks - 1} blocks while idle (another engine uses the pool)"
            )
        cache = self._new_cache()
        cache.adopt_free_order(order)
        self.cache = cache
        self._num_sent.clear()

    # -- RPC plumbing --------------------------------------------------------------------

    def _call(self, method: Callable[[], _T], what: str) -> _T:
        try:
            return method()
        except KVCacheError as err:
            raise KvsvcError(f"{self._where} failed to {what}: {err}") from None

    def _sync(self, step: Any, what: str) -> StepResultList:
        """Send ``step`` and wait for its reply (start-up and resyncs only)."""
        self.stats.sync_calls += 1
        self._step_rpcs += 1
        started = time.perf_counter()
        try:
            return self._call(step.send, what)
        finally:
            self.stats.seconds_waiting += time.perf_counter() - started

    def await_reply(self) -> None:
        """Wait for the Step sent last and check it against the replica's answers.

        Sets :attr:`needs_resync` when the server flagged requests for recompute or
        answered otherwise than predicted; the scheduler then preempts and resyncs.
        """
        in_flight = self._in_flight
        if in_flight is None:
            return
        self._in_flight = None
        future, prediction, num_operations = in_flight
        started = time.perf_counter()
        try:
            results = self._call(future.result, f"apply a Step of {num_operations} operations")
        finally:
            self.stats.seconds_waiting += time.perf_counter() - started
        if not future.then_result():
            self._check(prediction, results)

    def _as_predicted(self, prediction: Prediction, results: StepResultList) -> bool:
        """Whether a Step's reply is exactly what the replica answered (:func:`as_predicted`).

        Run by the client's sender thread as soon as the reply is in, while the engine
        computes: it reads only the reply and the prediction, which nothing changes once
        the Step is sent. Any other reply is looked at again by :meth:`_check`, on the
        scheduler's thread, which says what it is.
        """
        return as_predicted(prediction, results.response, self.num_groups)

    def _check(self, prediction: Prediction, results: StepResultList) -> None:
        """Compare a Step's reply with the replica's answers, column by column, and say
        what a reply other than the predicted one means (an error, an invalidation, a
        divergence)."""
        response = results.response
        if response.errors:
            index, error = min(response.errors.items())
            raise KvsvcError(
                f"{self._where} rejected operation {index} "
                f"({prediction.request_ids[index]!r}) of a Step: {error.message}"
            )
        statuses = list(response.statuses)
        if _RECOMPUTE in statuses:
            index = statuses.index(_RECOMPUTE)
            self._flag_resync(
                f"the pool's KV data was invalidated (request "
                f"{prediction.request_ids[index]!r} must be recomputed: a rank came back with "
                "fresh tensors, or an operator reset the pool by force)"
            )
            return
        if response.num_groups != self.num_groups:
            raise KvsvcError(
                f"{self._where} answered for {response.num_groups} KV cache groups, the "
                f"engine has {self.num_groups}"
            )
        if self._as_predicted(prediction, results):
            return
        divergence = describe_divergence(prediction, response, self.num_groups)
        usage = self._call(self._client.usage, "read the pool's usage")
        if usage.num_requests_needing_recompute:
            # Invalidated after the reply's first operations were applied: the replica
            # went on from a state the server left.
            self._flag_resync(divergence)
        elif usage.num_invalidations != self._invalidations_seen:
            # Invalidated with no request live (an operator's forced reset of an idle
            # engine's pool): nothing was flagged, but the prefix index the replica
            # predicted hits from is gone.
            self._flag_resync(f"the pool's prefix index was emptied; {divergence}")
        else:
            # Not a fault the pool reports: a bug, or a pool changed behind the engine's
            # back. Never let vLLM run on block ids the server did not hand out.
            raise KvsvcError(f"{self._where}: {divergence}")

    def _flag_resync(self, reason: str) -> None:
        if not self.needs_resync:
            logger.warning("%s: %s; preempting and resynchronising", self._where, reason)
        self.needs_resync = True
        self._resync_reason = reason

    def _take_pending(self) -> tuple[SyncStep, Prediction]:
        """The queued operations and the replica's answers to them; the queue starts empty
        (no step held)."""
        taken = self.pending, self._prediction
        self.pending, self._prediction = self._client.step(), Prediction()
        self._steps_held = 0
        self._admitted = False
        return taken

    def _send(self, *, in_step: bool = True) -> None:
        """Send the queued operations as one Step (after the previous one is answered);
        ``in_step``: counted as the scheduling step's RPC (a flush while idle is not)."""
        self.await_reply()
        self.stats.steps_by_call.append(self._steps_held)
        step, prediction = self._take_pending()
        prediction.num_free_blocks = self.cache.usage_free_blocks()
        self.stats.steps_sent += 1
        self.stats.operations_sent += len(step)
        if in_step:
            self._step_rpcs += 1
        check = functools.partial(self._as_predicted, prediction)
        self._in_flight = (step.send_future(then=check), prediction, len(step))

    # -- the per-step protocol -----------------------------------------------------------

    def end_step(self) -> int:
        """Send what the step queued without waiting; returns the step's RPC count.

        With ``steps_per_call`` > 1, a step that admitted nothing leaves its operations
        queued for a later step's Step, up to ``steps_per_call`` steps together (and
        while the queue is under :data:`HELD_OPERATIONS_LIMIT` operations).
        """
        if len(self.pending):
            self._steps_held += 1
            if (
                self._admitted
                or self._steps_held >= self._steps_per_call
                or len(self.pending) >= HELD_OPERATIONS_LIMIT
            ):
                self._send()
        count = self._step_rpcs
        self._step_rpcs = 0
        self.stats.rpcs_by_step.append(count)
        return count

    def flush(self) -> None:
        """Send everything queued and wait until the server applied it."""
        if len(self.pending):
            self._send(in_step=False)
        self.await_reply()

    def resync(self) -> None:
        """Bring the replica back to the server's state after :attr:`needs_resync`.

        The caller has freed (preempted) every request it holds, so the server's pool is
        idle once the queued frees are applied; their replies are not checked (the
        replica already diverged). The prefix cache is then reset (a flagged pool's KV
        data is gone, and blocks cached from a diverged step may not hold what their
        hashes say) and the replica rebuilt from the server's free queue.
        """
        if len(self.pending):
            step, _ = self._take_pending()
            self._in_flight = None
            self._sync(step, f"free {len(step)} requests for a resync")
        self._in_flight = None
        usage = self._call(self._client.usage, "read the pool's usage")
        if usage.num_requests:
            freed = self._call(self._client.free_needing_recompute, "free flagged requests")
            if usage.num_requests != freed:
                raise KvsvcError(
                    f"{self._where}: {usage.num_requests - freed} requests are still live after "
                    f"the engine preempted all of its own ({self._resync_reason})"
                )
        self._start_from_idle_pool(usage.num_invalidations)
        self.needs_resync = False
        self.stats.resyncs += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._client.close()

    # -- what the scheduler asks ---------------------------------------------------------

    def lookup(
        self,
        token_ids: Sequence[int],
        hashing: HashingContext | None,
        max_cache_hit_tokens: int | None = None,
    ) -> tuple[int, tuple[list[int], ...]]:
        """The prefix hit an admission of ``token_ids`` gets now: tokens, blocks per group
        (at most ``max_cache_hit_tokens``; None: all but the last token)."""
        try:
            return self.cache.lookup_capped(token_ids, core_hashing(hashing), max_cache_hit_tokens)
        except CoreError as exc:
            raise KvsvcError(f"{self._where}: {exc}") from None

    def blocks_to_admit(
        self,
        request_id: str,
        num_tokens: int,
        hits: Sequence[Sequence[int]],
        num_hit_tokens: int,
        num_encoder_tokens: int = 0,
    ) -> int:
        """Blocks the free queue must supply to admit a request with ``hits`` and
        ``num_tokens`` slots (vLLM's ``get_num_blocks_to_allocate`` of a new request)."""
        num_tokens = min(num_tokens, self.max_model_len)
        return self.cache.manager.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens, hits, num_encoder_tokens, num_hit_tokens, num_tokens
        )

    @property
    def num_free_blocks(self) -> int:
        return self.cache.usage_free_blocks()

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        start: RequestStart,
    ) -> tuple[list[int], ...] | None:
        """Admit a request the caller checked fits; returns its whole tables (None: the
        pool is short after all; nothing changed, nothing queued)."""
        core_start = CoreRequestStart(
            hashing=core_hashing(start.hashing),
            skip_prefix_cache_read=start.skip_prefix_cache_read,
            resumed=start.resumed,
            num_encoder_tokens=start.num_encoder_tokens,
            num_prompt_tokens=start.num_prompt_tokens,
            max_cache_hit_tokens=start.max_cache_hit_tokens,
            num_draft_tokens=start.num_draft_tokens,
        )
        try:
            outcome = self.cache.allocate(
                request_id, token_ids, num_new_tokens, num_lookahead_tokens, core_start
            )
        except CoreError as exc:
            raise KvsvcError(f"{self._where}: admission of {request_id!r}: {exc}") from None
        if not outcome.ok:
            return None
        self._num_sent[request_id] = len(token_ids)
        self.pending.allocate(
            request_id,
            token_ids,
            num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            start=start,
        )
        # Sent with this step's Step, whatever steps_per_call says: a new prompt's
        # blocks are what a router wants in the prefix index soonest, and a held Step
        # then carries no prompt.
        self._admitted = True
        self._predict(request_id, outcome.new_block_ids, outcome.num_null_blocks)
        self._prediction.num_cached_tokens[-1] = outcome.num_cached_tokens
        return self.tables(request_id)

    def allocate_running(
        self,
        request_id: str,
        all_token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        num_in_flight_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Slots for a running request: its new blocks per group, or None (the pool is
        short; nothing changed, nothing queued). ``num_in_flight_tokens``: vLLM's count
        of the request's scheduled tokens whose outputs are still coming (async
        scheduling)."""
        cache = self.cache
        request = cache.request_state(request_id)
        if request is None:
            raise KvsvcError(f"{self._where}: request {request_id!r} is not live in the replica")
        rejected = request.num_computed_tokens - num_computed_tokens
        if rejected < 0:
            raise KvsvcError(
                f"{self._where}: request {request_id!r} has {num_computed_tokens} computed "
                f"tokens in vLLM but {request.num_computed_tokens} in the pool"
            )
        sent = self._num_sent[request_id]
        tokens = all_token_ids[sent:]
        try:
            outcome = cache.allocate(
                request_id,
                tokens,
                num_new_tokens,
                num_lookahead_tokens,
                num_rejected_tokens=rejected,
                num_in_flight_tokens=num_in_flight_tokens,
            )
        except CoreError as exc:
            raise KvsvcError(f"{self._where}: allocation for {request_id!r}: {exc}") from None
        if not outcome.ok and not outcome.released:
            return None  # nothing changed: nothing to tell the server
        if outcome.ok:
            self._num_sent[request_id] = sent + len(tokens)
        self.pending.allocate(
            request_id,
            tokens,
            num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_rejected_tokens=rejected,
            num_in_flight_tokens=num_in_flight_tokens,
        )
        if not outcome.ok:
            # Refused, but the window's passed blocks were released before the check (as
            # vLLM releases them): the server must release the same ones, in this order.
            self._predict(request_id, (), outcome.num_null_blocks, _NO_SPACE)
            return None
        self._predict(request_id, outcome.new_block_ids, outcome.num_null_blocks)
        return outcome.new_block_ids

    def cache_outputs(
        self,
        request_id: str,
        all_token_ids: Sequence[int],
        num_computed_tokens: int,
        num_tokens_to_cache: int,
    ) -> None:
        """vLLM's ``cache_blocks(request, num_tokens_to_cache)`` after outputs arrived
        (async scheduling, speculative decoding): send the request's new tokens, the drafts
        vLLM rejected (``num_computed_tokens`` is vLLM's count after taking them off) and
        the tokens still in flight, so the pool caches exactly the blocks vLLM caches."""
        sent = self._num_sent.get(request_id)
        request = self.cache.request_state(request_id)
        if sent is None or request is None:
            return  # not admitted (or already freed): nothing to cache
        tokens = all_token_ids[sent:]
        rejected = request.num_computed_tokens - num_computed_tokens
        in_flight = num_computed_tokens - num_tokens_to_cache
        if rejected < 0 or in_flight < 0:
            raise KvsvcError(
                f"{self._where}: request {request_id!r} has {num_computed_tokens} computed "
                f"tokens in vLLM ({num_tokens_to_cache} to cache) but "
                f"{request.num_computed_tokens} in the pool"
            )
        if (
            not tokens
            and not rejected
            and not self.cache.would_cache(request_id, num_tokens_to_cache)
        ):
            return  # nothing for the pool to do
        try:
            outcome = self.cache.cache_outputs(
                request_id,
                tokens,
                num_rejected_tokens=rejected,
                num_in_flight_tokens=in_flight,
            )
        except CoreError as exc:
            raise KvsvcError(f"{self._where}: outputs of {request_id!r}: {exc}") from None
        self._num_sent[request_id] = sent + len(tokens)
        self.pending.cache(
            request_id, tokens, num_rejected_tokens=rejected, num_in_flight_tokens=in_flight
        )
        self._predict(request_id, outcome.new_block_ids, outcome.num_null_blocks)

    def free(self, request_id: str, *, preempted: bool) -> None:
        """Release a request (finished or preempted) here and queue it for the server."""
        if self._num_sent.pop(request_id, None) is None:
            return  # never admitted (vLLM frees requests that never got blocks)
        self.cache.free([request_id], preempted=preempted)
        if preempted:
            self.pending.preempt(request_id)
        else:
            self.pending.free(request_id)
        self._predict(request_id, (), ())

    def _predict(
        self,
        request_id: str,
        new_block_ids: Sequence[Sequence[int]],
        num_null_blocks: Sequence[int],
        status: int = _OK,
    ) -> None:
        """Record what the server must answer for the operation just queued."""
        self._prediction.add(request_id, new_block_ids, num_null_blocks, status, self.num_groups)

    def tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables per group (null id 0 where blocks were dropped)."""
        if not self.cache.has_request(request_id):
            return tuple([] for _ in range(self.num_groups))
        return self.cache.manager.coordinator.get_blocks(request_id)

    def cached_tokens(self, request_id: str) -> int:
        """vLLM's ``estimate_cached_tokens``: per cacheable group, the tokens up to the
        request's last block that is in the prefix index (a block a window skipped, or
        not yet full, is not); the smallest over the groups."""
        if not self.cache.has_request(request_id):
            return 0
        coordinator = self.cache.manager.coordinator
        cached_hashes = self.cache.manager.block_pool.block_hash
        counts = []
        for manager, table in zip(
            coordinator.managers, coordinator.get_blocks(request_id), strict=True
        ):
            if isinstance(manager, CrossAttentionManager):
                continue
            tokens = 0
            for index in range(len(table) - 1, -1, -1):
                block_id = table[index]
                if block_id and cached_hashes[block_id] is not None:
                    tokens = (index + 1) * manager.block_size
                    break
            counts.append(tokens)
        return min(counts) if counts else 0

    def usage(self) -> float:
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable if usable else 0.0

    def reset_prefix_cache(self) -> bool:
        """Reset the pool's prefix cache (refused while a request holds blocks)."""
        if self.cache.num_requests:
            return False
        if self.needs_resync:
            # The scheduler preempted everything for a resync: the replica's answers to
            # those frees are not the server's to check.
            self.resync()
            return True
        self.flush()
        reset = self._call(self._client.reset_prefix_cache, "reset the prefix cache")
        if reset:
            self.cache.reset_prefix_cache()
        return reset
