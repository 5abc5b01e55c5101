"""A simulated engine scheduler that drives kvsvc the way vLLM's scheduler drives its manager.

Each scheduling step builds ONE ``Step`` call: frees of finished requests, a decode (or
next prefill chunk) for every running request, then admissions from the waiting queue
while the step's token budget lasts. A running request that gets NO_SPACE is preempted
(the newest running one first, as vLLM does): it is freed with PREEMPT in the next step
and re-admitted later with its prompt plus the tokens it generated so far, which the
prefix cache mostly still holds.

The "model" samples deterministic pseudo-random tokens; nothing is computed. What is real
is every KV-cache call, its latency and the server's bookkeeping.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsvc_client import (
    AllocateResult,
    HashingContext,
    KVCacheClient,
    OperationError,
    RequestStart,
)


@dataclass(slots=True)
class Conversation:
    """A multi-turn chat: every turn's prompt extends the previous turn's prompt+answer."""

    tenant: int
    system_prompt: list[int]
    turns_left: int
    history: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    max_output_tokens: int
    conversation: Conversation
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    started: bool = False  # admitted (holds blocks on the server)
    resumed: bool = False  # preempted before
    pending_token: int | None = None  # sampled, to be sent with the next Allocate
    arrival: float = 0.0

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_output_tokens


@dataclass(slots=True)
class EngineStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    no_space: int = 0
    steps: int = 0
    step_latencies_s: list[float] = field(default_factory=list)
    peak_running: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def latency_percentile(self, q: float) -> float:
        if not self.step_latencies_s:
            return 0.0
        ordered = sorted(self.step_latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Shape of the simulated traffic.

    Attributes:
        num_requests: requests to finish (turns across all conversations).
        num_system_prompts: distinct shared system prompts (tenants).
        system_prompt_tokens: length range of a system prompt.
        user_tokens: length range of a user turn.
        output_tokens: length range of an answer.
        max_turns: turns per conversation (follow-ups reuse the whole history).
        max_running: requests decoding at once.
        token_budget: tokens scheduled per step (chunked prefill splits longer prompts).
        vocab_size: token ids are drawn from [0, vocab_size).
        max_model_len: cap on a request's length (histories are trimmed to fit).
        seed: makes the run reproducible.
    """

    num_requests: int = 300
    num_system_prompts: int = 4
    system_prompt_tokens: tuple[int, int] = (200, 600)
    user_tokens: tuple[int, int] = (20, 200)
    output_tokens: tuple[int, int] = (16, 128)
    max_turns: int = 4
    max_running: int = 48
    token_budget: int = 2048
    vocab_size: int = 32000
    max_model_len: int = 4096
    seed: int = 0


class SimulatedEngine:
    """Runs a workload against a pool through :class:`kvsvc_client.KVCacheClient`."""

    def __init__(self, client: KVCacheClient, workload: WorkloadConfig) -> None:
        self.client = client
        self.workload = workload
        self.rng = random.Random(workload.seed)
        self.stats = EngineStats()
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.to_free: list[tuple[str, bool]] = []  # (request id, preempted)
        self._next_request = 0
        self._issued = 0
        self._conversations: deque[Conversation] = deque()
        self._system_prompts = [
            self._tokens(self.rng.randint(*workload.system_prompt_tokens))
            for _ in range(workload.num_system_prompts)
        ]
        self._salts = [f"tenant-{i}" for i in range(workload.num_system_prompts)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.workload.vocab_size) for _ in range(n)]

    def _new_request(self) -> SimRequest | None:
        if self._issued >= self.workload.num_requests:
            return None
        w = self.workload
        if self._conversations and self.rng.random() < 0.6:
            conv = self._conversations.popleft()
        else:
            tenant = self.rng.randrange(len(self._system_prompts))
            conv = Conversation(tenant, self._system_prompts[tenant], w.max_turns)
            conv.history = list(conv.system_prompt)
        prompt = conv.history + self._tokens(self.rng.randint(*w.user_tokens))
        output_len = self.rng.randint(*w.output_tokens)
        # Keep the request within max_model_len: drop the oldest turns, keep the system prompt.
        overflow = len(prompt) + output_len - w.max_model_len
        if overflow > 0:
            keep = len(conv.system_prompt)
            prompt = prompt[:keep] + prompt[keep + overflow :]
        conv.turns_left -= 1
        self._issued += 1
        self._next_request += 1
        return SimRequest(
            request_id=f"req-{self._next_request}",
            prompt=prompt,
            max_output_tokens=output_len,
            conversation=conv,
            arrival=time.monotonic(),
        )

    def _sample(self) -> int:
        return self.rng.randrange(self.workload.vocab_size)

    def step(self) -> None:
        """One scheduling step: frees, running requests, admissions — in one Step call."""
        w = self.workload
        step = self.client.step()
        budget = w.token_budget
        ops: list[tuple[str, SimRequest | None]] = []
        for request_id, preempted in self.to_free:
            if preempted:
                step.preempt(request_id)
            else:
                step.free(request_id)
            ops.append(("free", None))
        self.to_free = []

        for req in self.running:
            if budget <= 0:
                break
            remaining_prompt = req.num_tokens - req.num_computed
            if req.pending_token is not None:
                step.allocate(req.request_id, [req.pending_token], 1)
                budget -= 1
            else:
                chunk = min(budget, remaining_prompt)
                if chunk <= 0:
                    continue
                step.allocate(req.request_id, (), chunk)
                budget -= chunk
            ops.append(("run", req))

        admitted: list[SimRequest] = []
        while budget > 0 and len(self.running) + len(admitted) < w.max_running:
            if not self.waiting:
                new = self._new_request()
                if new is None:
                    break
                self.waiting.append(new)
            req = self.waiting.popleft()
            tokens = req.all_tokens
            salt = self._salts[req.conversation.tenant]
            start = RequestStart(hashing=HashingContext(cache_salt=salt), resumed=req.resumed)
            step.allocate(req.request_id, tokens, budget, start=start)
            ops.append(("admit", req))
            admitted.append(req)
            budget -= min(budget, len(tokens))

        if not ops:
            return
        began = time.perf_counter()
        results = step.send()
        self.stats.step_latencies_s.append(time.perf_counter() - began)
        self.stats.steps += 1
        self._apply(ops, results)

    def _apply(self, ops: list[tuple[str, SimRequest | None]], results: Sequence[Any]) -> None:
        preempt: list[SimRequest] = []
        for (kind, req), result in zip(ops, results, strict=True):
            if kind == "free":
                continue
            assert req is not None
            if isinstance(result, OperationError):
                raise RuntimeError(f"{req.request_id}: {result.code.name}: {result.message}")
            assert isinstance(result, AllocateResult)
            if not result.ok:
                self.stats.no_space += 1
                if kind == "admit":
                    self.waiting.appendleft(req)  # try again next step
                else:
                    preempt.append(req)
                continue
            if kind == "admit":
                req.started = True
                self.running.append(req)
                if not req.resumed:
                    self.stats.prompt_tokens += len(req.prompt)
                    self.stats.cached_tokens += result.num_cached_tokens
            req.pending_token = None
            req.num_computed = result.num_computed_tokens
            self.stats.scheduled_tokens += result.num_scheduled_tokens
            if req.num_computed >= req.num_tokens:
                # Prefill done (or a decode step ran): the model samples the next token.
                token = self._sample()
                req.output.append(token)
                self.stats.generated_tokens += 1
                if req.done:
                    self._finish(req)
                else:
                    req.pending_token = token
        for req in preempt:
            self._preempt(req)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))

    def _finish(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.to_free.append((req.request_id, False))
        self.stats.requests_finished += 1
        conv = req.conversation
        conv.history = req.prompt + req.output
        if conv.turns_left > 0:
            self._conversations.append(conv)

    def _preempt(self, req: SimRequest) -> None:
        """Free the newest running request (vLLM's policy) to make room for ``req``."""
        victim = self.running[-1]
        self.running.remove(victim)
        self.to_free.append((victim.request_id, True))
        self.stats.preemptions += 1
        # The victim recomputes from scratch on resumption (the prefix cache helps).
        victim.num_computed = 0
        victim.resumed = True
        victim.started = False
        # A token sampled but not yet sent is already in ``output``: the resumed first
        # call carries prompt + output, so nothing is lost.
        victim.pending_token = None
        self.waiting.appendleft(victim)
        # ``req`` (if it was not the victim) keeps its pending token and retries next step.

    def run(
        self, progress: Callable[[SimulatedEngine], None] | None = None, progress_every: float = 0.5
    ) -> EngineStats:
        """Step until every request finished; call ``progress`` now and then."""
        last = time.monotonic()
        while True:
            if self._issued >= self.workload.num_requests and not self.waiting and not self.running:
                break
            self.step()
            now = time.monotonic()
            if progress is not None and now - last >= progress_every:
                progress(self)
                last = now
        if self.to_free:
            step = self.client.step()
            for request_id, preempted in self.to_free:
                if preempted:
                    step.preempt(request_id)
                else:
                    step.free(request_id)
            step.send()
            self.to_free = []
        return self.stats
