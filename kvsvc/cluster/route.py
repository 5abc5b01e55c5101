"""Route: which engine a prompt should go to, by its cached prefix and the engines' load.

The prefix alone is not a routing decision. In conversation traffic most prompts share a
first block (a system prompt), so the engine with the longest cached prefix is the same
one for nearly every prompt: routing by Score alone piles the load onto it, and the other
engines never cache anything (docs/cluster.md, "Routing", has the replay's numbers). Route
weighs both::

    score(e) = prefix_weight x cached(e) - load_weight x relative(e) x prompt tokens
    relative(e) = load(e) / max(mean load of the other candidates, load_floor)
    load(e) = running requests its server last reported + prompts routed to it since

and answers the highest score. The load term is in tokens too: an engine at twice the
others' mean load costs ``load_weight`` x the prompt more than one at it. Against the
others' mean (not all candidates', which an engine's own load raises) the penalty of an
engine that takes more and more of the load grows without bound, however long the prefix
it caches and however few the engines. ``load_floor`` (in requests) keeps a lightly loaded
fleet from scattering prompts away from their cache: one running request where the
others have none is no reason to recompute a whole prompt.

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
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvsvc.cluster.load import RECORD, LoadReport, redis_time_ms
from kvsvc.cluster.score import Prompt, Scorer, ScoreResult
from kvsvc.cluster.store import Registry
from kvsvc.errors import FailedPrecondition, InvalidArgument

DEFAULT_PREFIX_WEIGHT = 1.0
DEFAULT_LOAD_WEIGHT = 0.25
DEFAULT_LOAD_FLOOR = 1.0
# Weights past this are refused (their products would lose all precision).
MAX_WEIGHT = 1e6
# Candidates a Route names at most, and the longest name (together 4 MiB: the router
# reads requests with room for them beside the longest prompt).
MAX_ROUTE_CANDIDATES = 1 << 14
MAX_ENGINE_NAME_BYTES = 256
# An engine without a fresh report counts the prompts routed to it this long back.
MISSING_LOAD_WINDOW_S = 5.0
# How often a router measures its clock's offset from Redis's (TIME), seconds.
CLOCK_SYNC_S = 1.0
# The load vector's records as numpy reads them (kvsvc.cluster.load.RECORD).
_RECORD_DTYPE = [
    ("stamp", ">f8"),
    ("ttl", ">u4"),
    ("running", ">u4"),
    ("used", ">u4"),
    ("total", ">u4"),
]

TERMS = ("prefix", "load", "tie", "only")


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Route's weights (see the module's docstring).

    Attributes:
        prefix_weight: weight of the cached prefix tokens (>= 0).
        load_weight: weight of the load penalty, in prompt lengths per unit of relative
            load (>= 0).
        load_floor: the least mean load (of the other candidates) relative loads are
            taken against, in requests (> 0).
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
        relative: ``load`` / max(the other candidates' mean load, load_floor).
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
        # Prompts routed per engine since its last report: by engine id, the count, the
        # report's stamp it counts from (0: none fresh) and when counting began; by name
        # for candidates that are not indexed.
        self._pending = _Pending()
        self._turn = itertools.count()
        self._clustered = hasattr(scorer.client, "get_node_from_key")
        self._ids_cache: tuple[Registry, Any] | None = None
        self._clock = (0.0, -math.inf)  # (Redis ms - monotonic ms, when measured)

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
        registry = self.scorer.registry()
        prepared = self.scorer.prepare(prompt, wanted, registry=registry)
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
        chosen, runner_up = self._weigh(
            names, result, registry, vector, now_ms, policy, prompt.num_tokens, wanted is None
        )
        if runner_up is None:
            decided = "only"
        else:
            decided = decide(chosen, runner_up, policy, prompt.num_tokens)
        return RouteResult(
            chosen,
            runner_up,
            decided,
            prompt.num_tokens,
            len(names),
            result.seed_mismatch,
            result.upper_bound,
            policy,
        )

    def _ids(self, names: list[str], registry: Registry, every: bool) -> Any:
        """Each name's engine id (-1: not indexed), as an array; cached per registry read
        for the common case of every engine (``every``: the names are then the registry
        plan's, in its order)."""
        cached = self._ids_cache
        if every and cached is not None and cached[0] is registry:
            return cached[1]
        import numpy as np

        engines = registry.engines
        ids = np.array([engines[n][0] if n in engines else -1 for n in names], dtype=np.int64)
        if every:
            self._ids_cache = (registry, ids)
        return ids

    def _weigh(
        self,
        names: list[str],
        result: ScoreResult,
        registry: Registry,
        vector: bytes | None,
        now_ms: float,
        policy: RoutePolicy,
        tokens: int,
        every: bool,
    ) -> tuple[Candidate, Candidate | None]:
        """The chosen engine and the runner-up. Every candidate's load and score are
        numpy arrays (Route weighs 1,000 engines in tens of microseconds, where Python
        lists took half a millisecond); only the two answered become
        :class:`Candidate` objects."""
        import numpy as np

        ids = self._ids(names, registry, every)
        count = len(vector) // RECORD.size if vector else 0
        records = np.frombuffer(vector or b"", dtype=_RECORD_DTYPE, count=count)
        known = (ids >= 0) & (ids < count)
        rows = records[np.where(known, ids, 0)] if count else None
        if rows is not None:
            fresh = known & (rows["stamp"] > 0) & (now_ms - rows["stamp"] <= rows["ttl"])
            running = np.where(fresh, rows["running"], 0).astype(np.float64)
        else:
            fresh = np.zeros(len(names), dtype=bool)
            running = np.zeros(len(names))
        num_fresh = int(fresh.sum())
        missing = running.sum() / num_fresh if num_fresh else 0.0
        loads = np.where(fresh, running, missing)
        since = np.where(fresh, rows["stamp"], 0.0) if rows is not None else np.zeros(len(names))
        with self._lock:
            routed = self._pending.counts(ids, since, names, now_ms)
        loads += routed
        others = len(loads) - 1
        if others:
            mean_others = (loads.sum() - loads) / others
            relative = loads / np.maximum(mean_others, policy.load_floor)
        else:
            relative = loads / policy.load_floor
        load_cost = policy.load_weight * tokens
        scores = result.scores
        cached = np.fromiter(map(scores.get, names, repeat(0)), dtype=np.float64, count=len(names))
        values = policy.prefix_weight * cached - load_cost * relative
        best = values.max()
        tied = np.flatnonzero(values == best)
        pick = int(tied[next(self._turn) % len(tied)] if len(tied) > 1 else tied[0])
        with self._lock:
            self._pending.add(int(ids[pick]), float(since[pick]), names[pick], now_ms)
        second = None
        if len(values) > 1:
            values[pick] = -math.inf
            second = int(values.argmax())
            values[pick] = best

        def candidate(i: int) -> Candidate:
            report = None
            if fresh[i]:
                stamp, ttl, running, used, total = records[ids[i]].tolist()
                report = LoadReport(running, used, total, stamp, ttl)
            return Candidate(
                names[i],
                int(cached[i]),
                report,
                int(routed[i]),
                float(loads[i]),
                float(relative[i]),
                float(values[i]),
                (now_ms - report.stamp_ms) / 1000 if report is not None else 0.0,
            )

        return candidate(pick), candidate(second) if second is not None else None

    def _read(self, order: list[bytes]) -> tuple[list[bytes | None], bytes | None, float]:
        """The bitmaps of ``order`` and the load vector, in the scorer's one MGET (on a
        cluster one per slot, sent to every node in one pipelined round), and Redis's
        time now (:meth:`redis_now_ms`)."""
        values = self.scorer._read_bitmaps([*order, self.scorer.keys.load.encode()])
        return values[:-1], values[-1], self.redis_now_ms()

    def redis_now_ms(self) -> float:
        """Redis's clock now, in ms: this host's monotonic clock plus an offset measured
        with ``TIME`` (on the load vector's node) at most CLOCK_SYNC_S seconds ago, to
        within half a round trip. Load reports are stamped by Redis's clock: comparing
        them with this one needs no two hosts' clocks to agree, and costs Route no
        second command."""
        now = time.monotonic()
        with self._lock:
            offset, synced = self._clock
        if now - synced > CLOCK_SYNC_S:
            client: Any = self.scorer.client
            if self._clustered:
                client = client.get_node_from_key(self.scorer.keys.load).redis_connection
            before = time.monotonic()
            reply = client.time()
            after = time.monotonic()
            offset = redis_time_ms(reply) - (before + after) * 500
            with self._lock:
                self._clock = (offset, after)
        return now * 1000 + offset


class _Pending:
    """Prompts a router sent each engine since its last fresh report (or, without one,
    since counting began, at most MISSING_LOAD_WINDOW_S seconds ago): arrays by engine
    id, so a Route over 1,000 engines reads them in one step. Used under the router's
    lock."""

    def __init__(self) -> None:
        import numpy as np

        self.count = np.zeros(0, dtype=np.float64)
        self.since = np.zeros(0, dtype=np.float64)  # the report's stamp counted from
        self.start = np.zeros(0, dtype=np.float64)  # when the count began
        self.by_name: dict[str, tuple[int, float]] = {}  # not indexed: (count, start)

    def _grow(self, size: int) -> None:
        import numpy as np

        if size > len(self.count):
            extra = max(size, 2 * len(self.count)) - len(self.count)
            self.count = np.concatenate([self.count, np.zeros(extra)])
            self.since = np.concatenate([self.since, np.zeros(extra)])
            self.start = np.concatenate([self.start, np.zeros(extra)])

    def counts(self, ids: Any, since: Any, names: list[str], now_ms: float) -> Any:
        """Each candidate's count; a count whose engine reported since (another stamp)
        or, without a report, began over the window ago starts again from 0."""
        import numpy as np

        indexed = ids >= 0
        self._grow(max(1, int(ids.max()) + 1 if len(ids) else 0))
        at = np.where(indexed, ids, 0)
        window = MISSING_LOAD_WINDOW_S * 1000
        over = (self.since[at] != since) | ((since == 0) & (now_ms - self.start[at] > window))
        reset = at[indexed & over]
        self.count[reset] = 0.0
        out = np.where(indexed, self.count[at], 0.0)
        if not indexed.all():
            for i in np.flatnonzero(~indexed):
                n, start = self.by_name.get(names[i], (0, now_ms))
                out[i] = n if now_ms - start <= window else 0
        return out

    def add(self, engine_id: int, since: float, name: str, now_ms: float) -> None:
        """One more prompt routed to the engine."""
        if engine_id < 0:
            n, start = self.by_name.get(name, (0, now_ms))
            if now_ms - start > MISSING_LOAD_WINDOW_S * 1000:
                n, start = 0, now_ms
            self.by_name[name] = (n + 1, start)
            if len(self.by_name) > MAX_ROUTE_CANDIDATES:  # forget the oldest
                del self.by_name[next(iter(self.by_name))]
            return
        self._grow(engine_id + 1)
        if self.count[engine_id] == 0 or self.since[engine_id] != since:
            self.count[engine_id] = 0.0
            self.start[engine_id] = now_ms
        self.since[engine_id] = since
        self.count[engine_id] += 1
