"""vLLM's scheduler-side KV cache manager, answered by a kvsvc pool.

vLLM's scheduler asks its KV cache manager one question per running request per step
(``allocate_slots``: slots, or ``None`` to preempt) and one per admission
(``get_computed_blocks``: the cached prefix), and needs each answer at once. One RPC per
question would cost a round trip per request per step. This manager answers from a
mirror and lets the server decide everything that needs its state:

* **Which blocks a request gets.** The server owns the block pool. This manager mirrors
  only what it can know exactly: the block tables it was given, so every block's
  reference count and the number of free blocks, and the front of the server's free
  queue (``StepResponse.free_queue_head``), kept up to date by replaying on it what the
  server does: allocations take ids from the front, a prefix hit on a free block takes it
  out, a freed block goes to the front when it holds no hash and to the back when it does.
  So the answer to ``allocate_slots`` (enough free blocks or not, and which ids) is known
  locally, exactly as the server will decide it.
* **The cached prefix of an admission** needs the server's prefix index: that is the one
  synchronous call, a Step that carries the operations queued so far and a LOOKUP (so the
  server sees them in vLLM's order) and returns the hit and its blocks.
* **Everything else is queued** and sent as one Step per scheduling step, without waiting
  for its reply: the next call waits for it and checks that the server gave exactly the
  predicted ids, hits and free count. A mismatch is a bug and stops the engine with an
  error; it never lets vLLM run on block ids the server did not hand out.

The server stays the owner (a restart of vLLM or a router reading the pool sees the real
state); vLLM sees the same block ids, hits and preemptions it would see with its own
manager, because kvsvc's core keeps vLLM's free-queue order and hit rules.

Supported: pools with one full-attention KV cache group (dense decoder models), prefix
caching on or off, chunked prefill, preemption, speculative decoding's lookahead and
rejected tokens, cache salts, LoRA and multimodal hashing context. Not supported (refused
at start with a clear error): hybrid models (several groups or sliding windows), KV
connectors (P/D disaggregation, offloading), hash block sizes other than the block size.
"""

from __future__ import annotations

import hashlib
import logging
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
    LookupResult,
    MultiModalItem,
    RequestStart,
    StepFuture,
    StepResultList,
)

from kvsvc.integrations.vllm.config import KvsvcSettings
from kvsvc.v1 import kvcache_pb2 as pb

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_ALLOCATE = pb.STEP_OPERATION_TYPE_ALLOCATE
_FREE = pb.STEP_OPERATION_TYPE_FREE
_PREEMPT = pb.STEP_OPERATION_TYPE_PREEMPT
_LOOKUP = pb.STEP_OPERATION_TYPE_LOOKUP
_OK = pb.ALLOCATE_STATUS_OK
_RECOMPUTE = pb.ALLOCATE_STATUS_RECOMPUTE
# How many free-queue ids a refresh asks for: a decode step that crosses more block
# boundaries than the mirror knows ids for costs one synchronous refresh.
_HEAD_WINDOW = 1024
_MAX_HEAD = 65536  # the server's bound on free_queue_head_limit


class KvsvcError(RuntimeError):
    """kvsvc could not serve vLLM's KV cache manager (server unreachable, refused, or a
    reply that disagrees with the mirror); the message names the server and pool."""


@dataclass(slots=True)
class _Request:
    """The mirror of one live request: what the server holds for it."""

    table: list[int] = field(default_factory=list)
    # Tokens the server knows (prompt + outputs sent so far).
    num_sent_tokens: int = 0
    # The server's computed-token count after the operations sent or queued.
    num_computed_tokens: int = 0
    # Leading blocks of the table that carry a hash (full and cached): they go to the back
    # of the free queue when freed, the others to the front.
    num_hashed_blocks: int = 0


@dataclass(slots=True)
class _Expected:
    """What the server must answer for one queued operation."""

    kind: int
    request_id: str
    new_block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


@dataclass
class ManagerStats:
    """What the manager cost its engine (for benchmarks and logs)."""

    steps_sent: int = 0
    sync_calls: int = 0
    operations_sent: int = 0
    seconds_waiting: float = 0.0
    rpcs_by_step: list[int] = field(default_factory=list)


class KvsvcBlockMirror:
    """The engine-side half of a kvsvc pool: queued operations and the predicted state.

    vLLM-free (token lists and counts in, block ids out) so it is tested without vLLM;
    :class:`kvsvc.integrations.vllm.scheduler.KvsvcKVCacheManager` adapts vLLM's objects
    to it.

    Args:
        settings: the server and pool.
        num_blocks: blocks of the engine's KV cache, null block included (must be the
            pool's).
        block_size: tokens per block (must be the pool's).
        max_model_len: the engine's longest sequence.
        enable_caching: whether the engine caches prefixes (must match the pool).

    Raises:
        KvsvcError: the server is unreachable, the pool is another size, or the pool
            holds live requests of another engine.
    """

    def __init__(
        self,
        settings: KvsvcSettings,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
    ) -> None:
        self.settings = settings
        self.pool = settings.pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_blocks = num_blocks
        self._where = f"kvsvc server {settings.engine_target} (pool {settings.pool!r})"
        self._client = KVCacheClient(
            settings.engine_target,
            settings.pool,
            options=ClientOptions(
                timeout=settings.rpc_timeout,
                token=settings.auth_token,
                role="engine",
                tls_ca=settings.tls_ca,
                tls_cert=settings.tls_cert,
                tls_key=settings.tls_key,
                tls_server_name=settings.tls_server_name,
            ),
        )
        self.requests: dict[str, _Request] = {}
        self.ref_count = [0] * num_blocks
        self.head: deque[int] = deque()
        # Whether ``head`` is the whole free queue (then frees of cached blocks extend it).
        self.head_is_whole_queue = False
        self.num_free_blocks = 0
        self.pending = self._client.step()
        self._expected: list[_Expected] = []
        self._in_flight: tuple[StepFuture, list[_Expected], int] | None = None
        self.stats = ManagerStats()
        self._step_rpcs = 0
        self._closed = False
        self._free_known = False
        self._connect()

    # -- start ---------------------------------------------------------------------------

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
        # A new engine's KV tensors hold nothing: whatever the pool has cached was computed
        # in another engine's memory and must not be served as a hit.
        if not self._call(self._client.reset_prefix_cache, "reset the prefix cache"):
            raise KvsvcError(f"{self._where} refused to reset its prefix cache")
        self._refresh_head()

    # -- RPC plumbing --------------------------------------------------------------------

    def _call(self, method: Callable[[], _T], what: str) -> _T:
        try:
            return method()
        except KVCacheError as err:
            raise KvsvcError(f"{self._where} failed to {what}: {err}") from None

    def _await_in_flight(self) -> None:
        """Wait for the Step sent last and check its reply against the prediction."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        self._in_flight = None
        future, expected, expected_free = in_flight
        started = time.perf_counter()
        try:
            results = self._call(future.result, f"apply a Step of {len(expected)} operations")
        finally:
            self.stats.seconds_waiting += time.perf_counter() - started
        self._check(expected, results, expected_free)

    def _send(self, *, wait: bool, head_limit: int = 0) -> StepResultList | None:
        """Send the queued operations as one Step (after the previous one is answered)."""
        self._await_in_flight()
        step, expected = self.pending, self._expected
        self.pending, self._expected = self._client.step(), []
        step.free_queue_head_limit = head_limit
        self.stats.steps_sent += 1
        self.stats.operations_sent += len(step)
        self._step_rpcs += 1
        expected_free = self.num_free_blocks if self._free_known else -1
        if not wait:
            self._in_flight = (step.send_future(), expected, expected_free)
            return None
        self.stats.sync_calls += 1
        started = time.perf_counter()
        try:
            results = self._call(step.send, f"apply a Step of {len(step)} operations")
        finally:
            self.stats.seconds_waiting += time.perf_counter() - started
        self._check(expected, results, expected_free)
        return results

    def _check(
        self, expected: list[_Expected], results: StepResultList, expected_free: int
    ) -> None:
        """Fail loudly where the server's answer is not the one vLLM was given."""
        response = results.response
        if response.errors:
            index, error = min(response.errors.items())
            raise KvsvcError(
                f"{self._where} rejected operation {index} ({expected[index].request_id!r}) of "
                f"a Step: {error.message}"
            )
        if response.num_groups != 1:
            raise KvsvcError(f"{self._where} answered for {response.num_groups} KV cache groups")
        statuses = response.statuses
        new_ids = response.new_block_ids
        counts = response.num_new_blocks
        cached = response.num_cached_tokens
        pos = 0
        for i, op in enumerate(expected):
            n = counts[i]
            if op.kind == _ALLOCATE and statuses[i] == _RECOMPUTE:
                # The scheduler already ran on the mirror's answer: it cannot be taken back.
                raise KvsvcError(
                    f"{self._where}: the pool's KV data was invalidated (a rank came back "
                    "with fresh tensors, or a forced reset), so request "
                    f"{op.request_id!r} must be recomputed; vLLM on kvsvc does not re-admit "
                    "on ALLOCATE_STATUS_RECOMPUTE yet: restart the engine"
                )
            if op.kind == _ALLOCATE:
                got = list(new_ids[pos : pos + n])
                if (
                    statuses[i] != _OK
                    or got != op.new_block_ids
                    or cached[i] != op.num_cached_tokens
                ):
                    raise KvsvcError(
                        f"{self._where} diverged from the engine's mirror on "
                        f"{op.request_id!r}: expected blocks {op.new_block_ids} and "
                        f"{op.num_cached_tokens} cached tokens, got status "
                        f"{pb.AllocateStatus.Name(statuses[i])}, blocks {got} and "
                        f"{cached[i]} cached tokens"
                    )
            pos += n
        if expected_free >= 0 and response.num_free_blocks != expected_free:
            raise KvsvcError(
                f"{self._where} diverged from the engine's mirror: {response.num_free_blocks} "
                f"free blocks after a Step, the mirror expected {expected_free}"
            )

    def _refresh_head(self, at_least: int = 0) -> None:
        """Make the mirror's free-queue front exact (one synchronous, possibly empty Step)."""
        limit = min(max(_HEAD_WINDOW, at_least), _MAX_HEAD)
        results = self._send(wait=True, head_limit=limit)
        assert results is not None
        self.head = deque(results.free_queue_head)
        self.num_free_blocks = results.num_free_blocks
        self.head_is_whole_queue = len(self.head) == self.num_free_blocks
        self._free_known = True

    # -- the per-step protocol -----------------------------------------------------------

    def end_step(self) -> int:
        """Send what the step queued without waiting; returns the step's RPC count."""
        if len(self.pending):
            self._send(wait=False)
        count = self._step_rpcs
        self._step_rpcs = 0
        self.stats.rpcs_by_step.append(count)
        return count

    def flush(self) -> None:
        """Send everything queued and wait until the server applied it."""
        if len(self.pending):
            self._send(wait=False)
        self._await_in_flight()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._client.close()

    # -- the mirror ----------------------------------------------------------------------

    def _take_blocks(self, n: int) -> list[int]:
        """The ids the server's next allocation of ``n`` blocks takes (n <= free blocks)."""
        if n > len(self.head):
            self._refresh_head(n)
        head = self.head
        assert n <= len(head), "the free count said there were enough free blocks"
        taken = [head.popleft() for _ in range(n)]
        ref = self.ref_count
        for block_id in taken:
            ref[block_id] = 1
        self.num_free_blocks -= n
        return taken

    def _touch(self, block_ids: Sequence[int]) -> None:
        ref = self.ref_count
        for block_id in block_ids:
            if ref[block_id] == 0:
                self.num_free_blocks -= 1
                try:
                    self.head.remove(block_id)
                except ValueError:
                    if self.head_is_whole_queue:
                        raise KvsvcError(
                            f"{self._where}: prefix hit on block {block_id}, which the "
                            "mirror has neither held nor free"
                        ) from None
            ref[block_id] += 1

    def _release(self, state: _Request) -> None:
        """What the server's free does to the queue: the table tail first; blocks without
        a hash to the front (reused first), cached ones to the back (evicted last)."""
        ref = self.ref_count
        fresh: list[int] = []
        cached: list[int] = []
        table = state.table
        num_hashed = state.num_hashed_blocks if self.enable_caching else 0
        for j in range(len(table) - 1, -1, -1):
            block_id = table[j]
            count = ref[block_id] - 1
            ref[block_id] = count
            if count == 0:
                (cached if j < num_hashed else fresh).append(block_id)
        self.num_free_blocks += len(fresh) + len(cached)
        if fresh:
            self.head.extendleft(reversed(fresh))
        if cached and self.head_is_whole_queue:
            self.head.extend(cached)

    def _note_cached(self, state: _Request) -> None:
        if self.enable_caching:
            full = min(state.num_computed_tokens, state.num_sent_tokens) // self.block_size
            if full > state.num_hashed_blocks:
                state.num_hashed_blocks = full

    # -- what the scheduler asks ---------------------------------------------------------

    def lookup(
        self, token_ids: Sequence[int], hashing: HashingContext | None
    ) -> tuple[int, list[int]]:
        """The prefix hit an admission of ``token_ids`` gets now (one synchronous Step that
        also carries everything queued before it)."""
        self.pending.lookup(token_ids, hashing)
        self._expected.append(_Expected(_LOOKUP, ""))
        want_head = len(self.head) < _HEAD_WINDOW // 2 and not self.head_is_whole_queue
        results = self._send(wait=True, head_limit=_HEAD_WINDOW if want_head else 0)
        assert results is not None
        if want_head:
            self.head = deque(results.free_queue_head)
            self.head_is_whole_queue = len(self.head) == self.num_free_blocks
        hit = results[len(results) - 1]
        assert isinstance(hit, LookupResult)
        return hit.num_cached_tokens, list(hit.block_ids[0])

    def blocks_needed_to_admit(self, num_tokens: int, hits: Sequence[int]) -> int:
        """Blocks an admission with ``hits`` takes from the free queue for ``num_tokens``."""
        new = max(-(-num_tokens // self.block_size) - len(hits), 0)
        ref = self.ref_count
        return new + sum(1 for block_id in hits if ref[block_id] == 0)

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hits: Sequence[int],
        num_cached_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        start: RequestStart,
    ) -> list[int]:
        """Queue an admission the caller checked fits; returns the request's new blocks."""
        num_slots = min(
            num_cached_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_new = max(-(-num_slots // self.block_size) - len(hits), 0)
        if len(self.head) < num_new + len(hits) and not self.head_is_whole_queue:
            # Refresh before touching: the server has not seen this admission yet.
            self._refresh_head(num_new + len(hits))
        self._touch(hits)
        new = self._take_blocks(num_new)
        state = _Request(
            table=[*hits, *new],
            num_sent_tokens=len(token_ids),
            num_computed_tokens=num_cached_tokens + num_new_tokens,
            num_hashed_blocks=len(hits),
        )
        self._note_cached(state)
        self.requests[request_id] = state
        self.pending.allocate(
            request_id,
            token_ids,
            num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            start=start,
        )
        # The reply to a first call with a hit is the whole table, else the new blocks.
        self._expected.append(
            _Expected(
                _ALLOCATE,
                request_id,
                state.table[:] if num_cached_tokens else new,
                num_cached_tokens,
            )
        )
        return new

    def allocate_running(
        self,
        request_id: str,
        all_token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> list[int] | None:
        """Slots for a running request: its new blocks, or None (not enough free blocks;
        nothing queued, nothing changed)."""
        state = self.requests[request_id]
        computed = min(num_computed_tokens, self.max_model_len)
        num_slots = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        table = state.table
        needed = max(-(-num_slots // self.block_size) - len(table), 0)
        if needed > self.num_free_blocks:
            return None
        rejected = state.num_computed_tokens - num_computed_tokens
        if rejected < 0:
            raise KvsvcError(
                f"{self._where}: request {request_id!r} has {num_computed_tokens} computed "
                f"tokens in vLLM but {state.num_computed_tokens} in the pool"
            )
        new = self._take_blocks(needed) if needed else []
        if new:
            table.extend(new)
        sent = state.num_sent_tokens
        tokens = all_token_ids[sent:]
        state.num_sent_tokens = sent + len(tokens)
        state.num_computed_tokens = num_computed_tokens + num_new_tokens
        self._note_cached(state)
        self.pending.allocate(
            request_id,
            tokens,
            num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_rejected_tokens=rejected,
        )
        self._expected.append(_Expected(_ALLOCATE, request_id, new))
        return new

    def append_tokens(self, request_id: str, all_token_ids: Sequence[int]) -> None:
        """Async scheduling: outputs arrived after their slots were allocated; send them so
        the server caches the blocks they complete (a zero-token allocation)."""
        state = self.requests.get(request_id)
        if state is None:
            return
        tokens = all_token_ids[state.num_sent_tokens :]
        if not tokens:
            return
        state.num_sent_tokens += len(tokens)
        self._note_cached(state)
        self.pending.allocate(request_id, tokens, 0)
        self._expected.append(_Expected(_ALLOCATE, request_id))

    def free(self, request_id: str, *, preempted: bool) -> None:
        """Queue the release of a request (finished or preempted)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return  # never admitted (vLLM frees requests that never got blocks)
        self._release(state)
        if preempted:
            self.pending.preempt(request_id)
        else:
            self.pending.free(request_id)
        self._expected.append(_Expected(_PREEMPT if preempted else _FREE, request_id))

    def table(self, request_id: str) -> list[int]:
        state = self.requests.get(request_id)
        return state.table if state is not None else []

    def cached_tokens(self, request_id: str) -> int:
        state = self.requests.get(request_id)
        return state.num_hashed_blocks * self.block_size if state is not None else 0

    def usage(self) -> float:
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable if usable else 0.0

    def reset_prefix_cache(self) -> bool:
        self.flush()
        reset = self._call(self._client.reset_prefix_cache, "reset the prefix cache")
        if reset:
            # Every free block lost its hash; live requests hold none (else refused).
            self._refresh_head()
        return reset


def hashing_context(request: Any, block_size: int) -> HashingContext | None:
    """The hashing context of a vLLM request: what besides its tokens keys its blocks."""
    lora = getattr(request, "lora_request", None)
    items = tuple(
        MultiModalItem(str(f.identifier), f.mm_position.offset, f.mm_position.length)
        for f in getattr(request, "mm_features", None) or ()
    )
    digests: list[bytes] = []
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        # One digest per full block of the embeddings, as vLLM keys such blocks.
        data = embeds.detach().cpu().contiguous()
        for start in range(0, (data.shape[0] // block_size) * block_size, block_size):
            chunk = data[start : start + block_size].numpy().tobytes()
            digests.append(hashlib.sha256(chunk).digest())
    context = HashingContext(
        cache_salt=getattr(request, "cache_salt", None) or "",
        lora_name=lora.lora_name if lora is not None else "",
        lora_path=(getattr(lora, "lora_path", None) or "") if lora is not None else "",
        mm_items=items,
        prompt_embeds_digests=tuple(digests),
    )
    return None if context == HashingContext() else context
