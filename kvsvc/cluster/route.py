"""Route: which engine a prompt should go to, by its cached prefix and the engines' load.

The prefix alone is not a routing decision. In conversation traffic most prompts share a
first block (a system prompt), so the engine with the longest cached prefix is the same
one for nearly every prompt: routing by Score alone piles the load onto it, and the other
engines never cache anything (docs/cluster.md, "Routing", has the replay's numbers). Route
weighs both::

    score(e) = prefix_weight x cached(e) - load_weight x relative(e) x prompt tokens
    relative(e) = load(e) / max(mean load of the candidates, load_floor)
    load(e) = running requests its server last reported + prompts routed to it since

and answers the highest score. The load term is in tokens too: an engine at twice the mean
load costs ``load_weight`` x the prompt more than one at the mean. ``load_floor`` (in
requests) keeps a lightly loaded fleet from scattering prompts away from their cache: one
running request where the others have none is no reason to recompute a whole prompt.

What keeps a stale or missing load from sending everything to one engine:

- the prompts this router sent an engine since its last report count as load at once
  (its running count lags by the indexer's ``--load-interval``);
- an engine without a fresh report (past its TTL, never written, not indexed) counts the
  mean load of those that have one, plus what was routed to it in the last
  :data:`MISSING_LOAD_WINDOW_S` seconds, so it is neither shunned nor flooded;
- equal scores are broken by a rotation over the tied engines (never "the first").

Thread-safe: the router's threads share the routed-since counts.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvsvc.cluster.load import LoadReport, parse_vector, redis_time_ms
from kvsvc.cluster.score import Prompt, Scorer, ScoreResult
from kvsvc.errors import FailedPrecondition, InvalidArgument

DEFAULT_PREFIX_WEIGHT = 1.0
DEFAULT_LOAD_WEIGHT = 0.5
DEFAULT_LOAD_FLOOR = 1.0
# Weights past this are refused (their products would lose all precision).
MAX_WEIGHT = 1e6
# Candidates a Route names at most, and the longest name (together 4 MiB: the router
# reads requests with room for them beside the longest prompt).
MAX_ROUTE_CANDIDATES = 1 << 14
MAX_ENGINE_NAME_BYTES = 256
# An engine without a fresh report counts the prompts routed to it this long back.
MISSING_LOAD_WINDOW_S = 5.0

TERMS = ("prefix", "load", "tie", "only")


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Route's weights (see the module's docstring).

    Attributes:
        prefix_weight: weight of the cached prefix tokens (>= 0).
        load_weight: weight of the load penalty, in prompt lengths per unit of relative
            load (>= 0).
        load_floor: the least mean load relative loads are taken against, in requests
            (> 0).
    """

    prefix_weight: float = DEFAULT_PREFIX_WEIGHT
    load_weight: float = DEFAULT_LOAD_WEIGHT
    load_floor: float = DEFAULT_LOAD_FLOOR

    def check(self, where: str = "policy") -> RoutePolicy:
        """Returns self.

        Raises:
            InvalidArgument: a weight that is negative, not finite or past MAX_WEIGHT, or
                a floor that is not > 0 (the field named as ``<where>.<name>``).
        """
        for name in ("prefix_weight", "load_weight", "load_floor"):
            value = getattr(self, name)
            least = "> 0" if name == "load_floor" else ">= 0"
            if (
                not math.isfinite(value)
                or value < 0
                or value > MAX_WEIGHT
                or (name == "load_floor" and value == 0)
            ):
                raise InvalidArgument(f"{where}.{name}", f"{value!r} (must be {least} and <= 1e6)")
        return self


@dataclass(frozen=True, slots=True)
class Candidate:
    """One engine as Route weighed it.

    Attributes:
        engine: its name.
        cached: leading prompt tokens it has cached (as Score counts them).
        report: its server's last fresh load report (None: none within the TTL).
        routed_since: prompts this router sent it since that report (or, without one, in
            the last MISSING_LOAD_WINDOW_S seconds).
        load: the load weighed: running requests (or the candidates' mean without a
            report) plus ``routed_since``.
        relative: ``load`` / max(mean load, load_floor).
        score: prefix_weight x cached - load_weight x relative x prompt tokens.
        age_s: seconds since the report (Redis's clock; 0 without one).
    """

    engine: str
    cached: int
    report: LoadReport | None
    routed_since: int
    load: float
    relative: float
    score: float
    age_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RouteResult:
    """Route's answer.

    Attributes:
        chosen: the engine to send the prompt to.
        runner_up: the best of the others (None with one candidate).
        decided_by: ``"prefix"`` (the cached prefix outweighed the load difference),
            ``"load"`` (the lighter load outweighed the prefix difference), ``"tie"`` (equal
            scores: the rotation chose) or ``"only"`` (one candidate).
        num_prompt_tokens: the prompt's length.
        num_candidates: candidates weighed.
        seed_mismatch / upper_bound: as in :class:`kvsvc.cluster.score.ScoreResult`.
        policy: the weights used.
    """

    chosen: Candidate
    runner_up: Candidate | None
    decided_by: str
    num_prompt_tokens: int
    num_candidates: int
    seed_mismatch: tuple[str, ...]
    upper_bound: tuple[str, ...]
    policy: RoutePolicy


def check_candidates(engines: Sequence[str]) -> None:
    """Raises InvalidArgument naming ``engines`` past MAX_ROUTE_CANDIDATES names, or one
    name longer than MAX_ENGINE_NAME_BYTES."""
    if len(engines) > MAX_ROUTE_CANDIDATES:
        raise InvalidArgument(
            "engines", f"{len(engines)} candidates exceed the limit of {MAX_ROUTE_CANDIDATES}"
        )
    for i, name in enumerate(engines):
        if len(name.encode()) > MAX_ENGINE_NAME_BYTES:
            raise InvalidArgument(f"engines[{i}]", f"longer than {MAX_ENGINE_NAME_BYTES} bytes")


def decide(chosen: Candidate, runner_up: Candidate, policy: RoutePolicy, tokens: int) -> str:
    """Which term set ``chosen`` apart from ``runner_up``: the one in its favour, or the
    larger of the two when both are."""
    if chosen.score == runner_up.score:
        return "tie"
    by_prefix = policy.prefix_weight * (chosen.cached - runner_up.cached)
    by_load = policy.load_weight * tokens * (runner_up.relative - chosen.relative)
    if by_prefix > 0 and by_load <= 0:
        return "prefix"
    if by_load > 0 and by_prefix <= 0:
        return "load"
    return "prefix" if by_prefix >= by_load else "load"


class Router:
    """Answers Route from the index and the engines' loads in Redis (one round trip).

    Args:
        scorer: the index's scorer (its Redis client, seed and key layout).
        policy: the weights a call uses when it gives none.
    """

    def __init__(self, scorer: Scorer, policy: RoutePolicy | None = None) -> None:
        self.scorer = scorer
        self.policy = (policy or RoutePolicy()).check()
        self._lock = threading.Lock()
        self._routed: dict[str, list[float]] = {}  # engine -> Redis ms of each route
        self._turn = itertools.count()
        self._clustered = hasattr(scorer.client, "get_node_from_key")

    def route(
        self,
        prompt: Prompt,
        engines: Collection[str] | None = None,
        policy: RoutePolicy | None = None,
    ) -> RouteResult:
        """The engine ``prompt`` should go to.

        Args:
            prompt: a :class:`kvsvc.cluster.score.TokenPrompt` or ``HashesPrompt``.
            engines: the candidates (None: every indexed engine).
            policy: weights for this call (None: the router's).

        Raises:
            InvalidArgument: bad input (see :meth:`Scorer.prepare`, RoutePolicy.check,
                check_candidates).
            FailedPrecondition: no candidate (none named, none indexed).
        """
        policy = (policy or self.policy).check()
        if engines is not None:
            check_candidates(list(engines))
        wanted = set(engines) if engines else None
        prepared = self.scorer.prepare(prompt, wanted)
        bitmaps, vector, now_ms = self._read(prepared.order)
        result = self.scorer.finish(prepared, bitmaps)
        names = list(result.scores)
        if wanted:  # named but not indexed: nothing cached, no load known
            names += sorted(wanted.difference(result.scores))
        if not names:
            raise FailedPrecondition(
                "no engine to route to: none is indexed (is `kvsvc indexer` running?)"
                if wanted is None
                else "no engine to route to"
            )
        registry = self.scorer.registry()
        candidates = self._weigh(names, result, registry.engines, vector, now_ms, policy, prompt)
        best = max(c.score for c in candidates)
        tied = [c for c in candidates if c.score == best]
        chosen = tied[next(self._turn) % len(tied)] if len(tied) > 1 else tied[0]
        others = [c for c in candidates if c is not chosen]
        runner_up = max(others, key=lambda c: c.score) if others else None
        with self._lock:
            self._routed.setdefault(chosen.engine, []).append(now_ms)
        if runner_up is None:
            decided = "only"
        else:
            decided = decide(chosen, runner_up, policy, prompt.num_tokens)
        return RouteResult(
            chosen,
            runner_up,
            decided,
            prompt.num_tokens,
            len(candidates),
            result.seed_mismatch,
            result.upper_bound,
            policy,
        )

    def _weigh(
        self,
        names: list[str],
        result: ScoreResult,
        ids: dict[str, Any],
        vector: bytes | None,
        now_ms: float,
        policy: RoutePolicy,
        prompt: Prompt,
    ) -> list[Candidate]:
        """Every candidate's load, relative load and score."""
        scores = result.scores
        reports: list[LoadReport | None] = []
        routed: list[int] = []
        known = 0.0
        num_known = 0
        window_start = now_ms - MISSING_LOAD_WINDOW_S * 1000
        with self._lock:
            for name in names:
                entry = ids.get(name)
                report = parse_vector(vector, entry[0]) if entry is not None else None
                if report is not None and not report.fresh(now_ms):
                    report = None
                since = report.stamp_ms if report is not None else window_start
                stamps = self._routed.get(name)
                count = 0
                if stamps:
                    # What the report counts already, or what fell out of the window, is
                    # never counted again (stamps are in route order).
                    if stamps[0] <= since:
                        stamps[:] = [s for s in stamps if s > since]
                    count = len(stamps)
                    if not stamps:
                        del self._routed[name]
                reports.append(report)
                routed.append(count)
                if report is not None:
                    known += report.running
                    num_known += 1
        missing = known / num_known if num_known else 0.0
        loads = [
            (r.running if r is not None else missing) + n
            for r, n in zip(reports, routed, strict=True)
        ]
        mean = sum(loads) / len(loads)
        scale = 1.0 / max(mean, policy.load_floor)
        tokens = prompt.num_tokens
        prefix_weight = policy.prefix_weight
        load_cost = policy.load_weight * tokens * scale
        out = []
        for name, report, count, load in zip(names, reports, routed, loads, strict=True):
            cached = scores.get(name, 0)
            out.append(
                Candidate(
                    name,
                    cached,
                    report,
                    count,
                    load,
                    load * scale,
                    prefix_weight * cached - load_cost * load,
                    (now_ms - report.stamp_ms) / 1000 if report is not None else 0.0,
                )
            )
        return out

    def _read(self, order: list[bytes]) -> tuple[list[bytes | None], bytes | None, float]:
        """The bitmaps of ``order``, the load vector and Redis's time: one pipelined round
        trip on a single Redis; on a cluster the bitmaps (one round to every node) and
        then the vector with its node's time."""
        client: Any = self.scorer.client
        key = self.scorer.keys.load
        if not self._clustered:
            pipe = client.pipeline(transaction=False)
            if order:
                pipe.mget(order)
            pipe.get(key)
            pipe.time()
            replies = pipe.execute()
            bitmaps = replies[0] if order else []
            return bitmaps, replies[-2], redis_time_ms(replies[-1])
        bitmaps = self.scorer._read_bitmaps(order) if order else []
        node = client.get_node_from_key(key)
        pipe = node.redis_connection.pipeline(transaction=False)
        pipe.get(key)
        pipe.time()
        vector, now = pipe.execute()
        return bitmaps, vector, redis_time_ms(now)
