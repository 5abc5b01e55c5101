"""The service model, and the simulated engine that drives one real pool with it.

The model (what an engine's time goes to; every figure a flag of ``kvsvc replay``):

- An engine runs steps back to back while it has requests, as vLLM's scheduler does. A
  step takes ``max_batched_tokens`` tokens at most: one per decoding request first, then
  chunks of the prompts being prefilled (running ones first, then admissions, FCFS).
- A step lasts ``prefill tokens / prefill_tps`` plus ``decode_s`` per iteration. Only the
  part of a prompt that is not cached is prefilled: that is what a cache hit saves.
- A step with no prefill runs up to ``step_iterations`` decode iterations in one ``Step``
  call (multi-step scheduling), cut short where a request finishes or a new request
  arrives, so admissions are not delayed.
- Admissions are bounded by the pool: a first ``Allocate`` answered ``NO_SPACE`` leaves
  the request waiting (and the ones behind it: FCFS); running requests at most
  ``max_num_seqs``. A running request whose step allocation gets ``NO_SPACE`` makes the
  engine preempt its newest running request (freed as preempted, back to the head of the
  queue; it is admitted again with its prompt and outputs so far, recomputing what is not
  cached), as vLLM's recompute preemption does.
- A request's first token comes at the end of the step that finishes its prefill (its
  TTFT: that time minus its arrival); it is freed at the end of the step that generates
  its last token.

Every request is a real one on the engine's ``kvsvc serve`` pool: the first ``Allocate``
(admission, with the whole prompt) looks up the cached prefix, ``Step`` appends and
allocates, ``Free`` releases, so the pool's blocks are held while requests run and
evicted in its own LRU order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvsvc.replay.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """What an engine's time goes to (see the module's docstring).

    Attributes:
        prefill_tps: prompt tokens an engine prefills per second (the uncached part).
        decode_s: seconds of one decode iteration (one token for every decoding request).
        max_batched_tokens: tokens one step computes at most (vLLM's
            max_num_batched_tokens).
        max_num_seqs: running requests per engine at most.
        step_iterations: decode iterations one Step call may cover.
    """

    prefill_tps: float = 10_000.0
    decode_s: float = 0.03
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    step_iterations: int = 16

    def check(self) -> ServiceModel:
        """Returns self.

        Raises:
            ValueError: a figure out of range (naming its flag).
        """
        if not self.prefill_tps > 0:
            raise ValueError(f"--prefill-tps must be > 0, got {self.prefill_tps:g}")
        if not self.decode_s > 0:
            raise ValueError(f"--decode-ms must be > 0, got {self.decode_s * 1000:g}")
        for flag, value in (
            ("--max-batched-tokens", self.max_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--step-iterations", self.step_iterations),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        return self


@dataclass(slots=True)
class Request:
    """A trace request on its engine."""

    trace: TraceRequest
    engine: int
    prompt: list[int] | None = None  # its tokens, made when first admitted
    computed: int = 0  # tokens computed (prompt and outputs)
    outputs: int = 0  # tokens generated so far
    appended: int = 0  # of those, sent to the pool (the last one sampled is not yet)
    live: bool = False  # admitted on the pool (not freed or preempted)
    prefilled: bool = False  # prompt (and, resumed, outputs so far) computed
    chunk: int = 0  # tokens scheduled in the current step
    admitted_at: float | None = None
    first_token_at: float | None = None
    cached: int | None = None  # cached tokens at its first admission

    @property
    def rid(self) -> str:
        return f"r{self.trace.index}"

    @property
    def length(self) -> int:
        """Tokens its prefill computes: the prompt, and when resumed after a preemption
        the outputs it had (vLLM recomputes them all, then samples the next one)."""
        return self.trace.input_length + self.appended

    @property
    def left(self) -> int:
        """Decode iterations still to run (the first token comes from the prefill)."""
        return self.trace.output_length - self.outputs


@dataclass(slots=True)
class EngineStats:
    """One engine's counts over a replay."""

    prompt_tokens: int = 0  # of the requests it admitted (first admissions)
    cached_tokens: int = 0  # served from its cache at those admissions
    computed_tokens: int = 0  # prefill (recomputation included) and decode tokens
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0


@dataclass(slots=True)
class SimEngine:
    """One simulated engine on its pool (a :class:`kvsvc_client.KVCacheClient`).

    :meth:`start_step` plans a step at a time and makes its calls (``Step`` for the
    running requests, ``Allocate`` for admissions); it returns when the step ends.
    :meth:`end_step` applies that end: first tokens, finished requests freed.
    """

    index: int
    client: Any
    model: ServiceModel
    block_size: int
    stats: EngineStats = field(default_factory=EngineStats)
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    busy: bool = False
    # An admission got NO_SPACE and no request finished or was preempted since: the pool
    # cannot take the queue's head yet (only a free gives blocks back), so it is not
    # asked again until then.
    blocked: bool = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def start_step(self, now: float, next_arrival: float | None) -> float:
        """Plan and send one step at ``now``; returns its end time."""
        from kvsvc_client import RequestStart

        model = self.model
        budget = model.max_batched_tokens
        decoding = [r for r in self.running if r.prefilled]
        prefilling = [r for r in self.running if not r.prefilled]
        admitting = (
            bool(self.waiting) and not self.blocked and len(self.running) < model.max_num_seqs
        )
        prefill_work = bool(prefilling) or admitting
        if prefill_work:
            iterations = 1
        else:
            iterations = min([model.step_iterations, *(r.left for r in decoding)])
            if next_arrival is not None:
                until = int((next_arrival - now) / model.decode_s) + 1
                iterations = max(1, min(iterations, until))
        step = self.client.step()
        planned: list[Request] = []
        for r in decoding:
            n = min(iterations, r.left)
            # The tokens sampled before this step go in; their KV is computed in it.
            step.allocate(r.rid, r.trace.output_tokens(r.appended, n), n)
            r.chunk = n
            planned.append(r)
            budget -= 1
        for r in prefilling:
            chunk = min(max(0, budget), r.length - r.computed)
            if chunk <= 0:
                r.chunk = 0
                continue
            step.allocate(r.rid, (), chunk)
            r.chunk = chunk
            planned.append(r)
            budget -= chunk
        prefill_tokens = 0
        if planned:
            results = step.send()
            refused = set(results.no_space_indices())
            for i, r in enumerate(planned):
                if i in refused:
                    r.chunk = 0
            for i in sorted(refused):
                self._preempt_newest(planned[i])
            for r in planned:
                if not r.chunk:
                    continue
                r.computed += r.chunk
                if r.prefilled:
                    r.appended += r.chunk
                else:
                    prefill_tokens += r.chunk
        # Admissions, FCFS, with what is left of the budget.
        while admitting and self.waiting and budget > 0 and len(self.running) < model.max_num_seqs:
            r = self.waiting[0]
            first = r.admitted_at is None
            if r.prompt is None:
                r.prompt = r.trace.prompt_tokens(self.block_size)
            # Resumed: the prompt and every token sampled so far.
            r.appended = 0 if first else r.outputs
            tokens = r.prompt if first else r.prompt + r.trace.output_tokens(0, r.appended)
            start = RequestStart(resumed=not first, num_prompt_tokens=r.trace.input_length)
            result = self.client.allocate(r.rid, tokens, budget, start=start)
            if not result.ok:
                self.blocked = True  # the pool is full: it (and those behind it) wait
                break
            self.waiting.popleft()
            r.live = True
            r.computed = result.num_cached_tokens + result.num_scheduled_tokens
            r.chunk = result.num_scheduled_tokens
            r.prefilled = False
            budget -= r.chunk
            prefill_tokens += r.chunk
            if first:
                r.admitted_at = now
                r.cached = result.num_cached_tokens
                self.stats.prompt_tokens += r.trace.input_length
                self.stats.cached_tokens += result.num_cached_tokens
            self.running.append(r)
        decode_tokens = sum(r.chunk for r in decoding if r.chunk and r.live)
        self.stats.computed_tokens += prefill_tokens + decode_tokens
        self.stats.steps += 1
        duration = prefill_tokens / model.prefill_tps + iterations * model.decode_s
        self.stats.busy_s += duration
        self.busy = True
        return now + duration

    def _preempt_newest(self, refused: Request) -> None:
        """``refused`` got NO_SPACE: free the newest running request (``refused`` itself
        when it is the newest) as preempted; it waits at the head of the queue."""
        if not refused.live:
            return  # preempted already by an earlier refusal of this step
        victim = next(r for r in reversed(self.running) if r.live)
        self.client.free(victim.rid, preempted=True)
        self.blocked = False
        victim.live = False
        victim.prefilled = False
        victim.computed = 0
        victim.chunk = 0
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def end_step(self, now: float) -> list[Request]:
        """The step ends at ``now``: prefills that completed give their first token,
        decodes their tokens; finished requests are freed. Returns them."""
        self.busy = False
        done = []
        for r in self.running:
            if not r.chunk:
                continue
            if r.prefilled:
                r.outputs += r.chunk
            elif r.computed >= r.length:
                r.prefilled = True  # and it samples a token
                r.outputs += 1
                if r.first_token_at is None:
                    r.first_token_at = now
            r.chunk = 0
            if r.prefilled and r.left <= 0:
                done.append(r)
        if done:
            self.client.free(*(r.rid for r in done))
            self.blocked = False
            for r in done:
                r.live = False
                self.running.remove(r)
        return done
