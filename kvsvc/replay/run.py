"""The replay's clock and routing policies: a trace through a fleet, per policy.

Time is the trace's, simulated: events (arrivals, the ends of engine steps) are taken in
time order, and each waits until the wall clock reaches its time divided by
``time_scale`` before it runs. The servers, the indexer (its event stream, its load
reports every ``--load-interval`` seconds) and the router run in real time beside it, so
their lags are real seconds: at a larger scale they are more trace seconds, as if the
engines were that much faster. Where the replay's own calls cannot keep up, events run
late (the report says by how much at most).

Policies (the router's Route for all but round robin, so the load they see is what the
indexer wrote):

- ``round-robin``: engine ``i % E`` for the ``i``-th request;
- ``least-loaded``: Route with prefix weight 0 (the lightest load; ties rotate);
- ``prefix-only``: Route with load weight 0 (the longest cached prefix, what Score alone
  leads to; ties rotate, never "the first engine");
- ``route``: Route with the router's weights.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsvc.cluster.route import RoutePolicy
from kvsvc.replay.engine import EngineStats, Request, ServiceModel, SimEngine
from kvsvc.replay.fleet import POOL, Fleet
from kvsvc.replay.trace import TraceRequest

POLICIES = ("round-robin", "least-loaded", "prefix-only", "route")
CALL_TIMEOUT_S = 60.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank; 0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True)
class PolicyResult:
    """One policy's replay.

    Attributes:
        policy: its name.
        hit_ratio: prompt tokens served from cache at admission / prompt tokens.
        load_max_mean: the busiest engine's computed tokens (prefill, recomputation
            included, and decode) over the engines' mean.
        preemptions: requests preempted (all engines).
        queue_p50_s / queue_p99_s: from arrival to admission, trace seconds.
        ttft_p50_s / ttft_p99_s: from arrival to the first token, trace seconds.
        requests: requests replayed.
        completed: of those, requests that generated their last token and were freed.
        decided_by: Route's answers by the term that decided (Route policies only).
        late_max_s: the most an event ran after its time (wall seconds; 0: the replay
            kept up).
        wall_s: wall seconds of the replay (the fleet's start excluded).
        engines: per engine, its counts.
    """

    policy: str
    hit_ratio: float
    load_max_mean: float
    preemptions: int
    queue_p50_s: float
    queue_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests: int
    completed: int = 0
    decided_by: dict[str, int] = field(default_factory=dict)
    late_max_s: float = 0.0
    wall_s: float = 0.0
    engines: list[EngineStats] = field(default_factory=list)


def policy_weights(name: str, policy: RoutePolicy) -> RoutePolicy | None:
    """The Route weights of a named policy (None: the router's own)."""
    if name == "least-loaded":
        return RoutePolicy(0.0, 1.0, policy.load_floor)
    if name == "prefix-only":
        return RoutePolicy(1.0, 0.0, policy.load_floor)
    return None


def replay(
    trace: Sequence[TraceRequest],
    fleet: Fleet,
    policy_name: str,
    model: ServiceModel,
    time_scale: float,
    progress: Callable[[str], None] | None = None,
) -> PolicyResult:
    """Replay ``trace`` through ``fleet`` (started) with one routing policy."""
    from kvsvc_client import ClientOptions, KVCacheClient

    from kvsvc.cluster.router import ClusterIndexClient

    options = ClientOptions(timeout=CALL_TIMEOUT_S)
    clients = [KVCacheClient(a, POOL, options=options) for a in fleet.addresses]
    index_of = {source: i for i, source in enumerate(fleet.sources)}
    engines = [SimEngine(i, c, model, fleet.block_size) for i, c in enumerate(clients)]
    router = ClusterIndexClient(fleet.router_address, timeout=CALL_TIMEOUT_S)
    weights = policy_weights(policy_name, fleet.policy)
    decided: Counter[str] = Counter()
    requests: list[Request] = []
    turn = 0

    def choose(r: Request) -> int:
        nonlocal turn
        if policy_name == "round-robin":
            turn += 1
            return (turn - 1) % len(engines)
        answer = router.route(r.prompt or [], policy=weights)
        decided[answer.decided_by] += 1
        return index_of[answer.chosen.engine]

    ends: list[tuple[float, int, int]] = []  # (time, order, engine)
    order = 0
    late = 0.0
    started = time.monotonic()
    last_said = started

    def wait_until(t: float) -> None:
        nonlocal late
        delay = started + t / time_scale - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            late = max(late, -delay)

    def run_step(engine: SimEngine, t: float, next_arrival: float | None) -> None:
        nonlocal order
        end = engine.start_step(t, next_arrival)
        heapq.heappush(ends, (end, order, engine.index))
        order += 1

    position = 0
    try:
        while position < len(trace) or ends:
            arrival = trace[position].arrival_s if position < len(trace) else None
            if ends and (arrival is None or ends[0][0] <= arrival):
                t, _, i = heapq.heappop(ends)
                wait_until(t)
                engine = engines[i]
                engine.end_step(t)
                if engine.has_work:
                    run_step(engine, t, arrival)
                continue
            assert arrival is not None
            wait_until(arrival)
            r = Request(trace[position], -1)
            position += 1
            r.prompt = r.trace.prompt_tokens(fleet.block_size)
            r.engine = choose(r)
            requests.append(r)
            engine = engines[r.engine]
            engine.waiting.append(r)
            if not engine.busy:
                nxt = trace[position].arrival_s if position < len(trace) else None
                run_step(engine, arrival, nxt)
            if progress is not None and time.monotonic() - last_said >= 30:
                last_said = time.monotonic()
                progress(f"{policy_name}: {position}/{len(trace)} requests")
    finally:
        router.close()
        for client in clients:
            client.close()
    wall = time.monotonic() - started
    return summarize(policy_name, requests, engines, dict(decided), late, wall)


def summarize(
    name: str,
    requests: Sequence[Request],
    engines: Sequence[SimEngine],
    decided: dict[str, int],
    late: float,
    wall: float,
) -> PolicyResult:
    stats = [e.stats for e in engines]
    prompt = sum(s.prompt_tokens for s in stats)
    cached = sum(s.cached_tokens for s in stats)
    computed = [s.computed_tokens for s in stats]
    mean = sum(computed) / len(computed)
    queue = [r.admitted_at - r.trace.arrival_s for r in requests if r.admitted_at is not None]
    ttft = [r.first_token_at - r.trace.arrival_s for r in requests if r.first_token_at is not None]
    return PolicyResult(
        policy=name,
        hit_ratio=cached / prompt if prompt else 0.0,
        load_max_mean=max(computed) / mean if mean else 0.0,
        preemptions=sum(s.preemptions for s in stats),
        queue_p50_s=statistics.median(queue) if queue else 0.0,
        queue_p99_s=percentile(queue, 0.99),
        ttft_p50_s=statistics.median(ttft) if ttft else 0.0,
        ttft_p99_s=percentile(ttft, 0.99),
        requests=len(requests),
        completed=sum(1 for r in requests if r.trace.output_length - r.outputs <= 0 and not r.live),
        decided_by=decided,
        late_max_s=late,
        wall_s=wall,
        engines=stats,
    )


def fits(trace: Sequence[TraceRequest], capacity_tokens: int, block_size: int) -> Any:
    """The first request that cannot fit in one engine's pool alone (None: all fit)."""
    blocks = capacity_tokens // block_size
    for r in trace:
        if -(-(r.input_length + r.output_length) // block_size) > blocks:
            return r
    return None
