"""Score: per indexed engine, how many leading tokens of a prompt it has cached.

An engine's score is what its own ``Lookup`` answers for the prompt: the server's hit
rule (``HybridCoordinator.find_longest_cache_hit``) over the classes the index tracks
for it (layout.py), capped so at least one token is left to compute, in tokens.

- Full attention alone (one class, the common case): the longest run of leading blocks
  whose hashes it caches in every group; engine ``i``'s score is the block at which its
  bit first drops out, times its block size (one big-int AND per block).
- Hybrid (sliding-window groups, or full attention of several block sizes): the longest
  length, a multiple of the lcm of all its groups' block sizes, that every class
  accepts. A full-attention class accepts a length while all its blocks before it are
  cached; a sliding-window class of window ``w`` and block size ``b`` while the
  ``cdiv(w - 1, b)`` blocks before it are (all of them, from block 0, when there are
  fewer). Per class an acceptance bitmap per block count (prefix ANDs; windowed ANDs in
  three ANDs per block whatever the window), then the lengths longest first, each engine
  taking the first that all its classes accept: big-int operations over all engines of
  one rule at once, never a loop over engine x block.
- Groups of kinds the index cannot follow (Mamba, chunked local or cross attention):
  the score is the tracked classes' hit, an upper bound of ``Lookup``
  (``ScoreResult.upper_bound`` names those engines).

Hashes come from :class:`kvsvc.cluster.hashing.PromptHasher` (the servers' core code)
once per distinct ``(hash algorithm, hash block size, block size)`` among the engines;
all of a prompt's bitmaps are read in one pipelined round trip, then intersected in
process.

Cost: one Redis round trip (per node of a cluster) carrying ``blocks x classes x bitmap
bytes`` (a 4,096-token prompt over 1,000 engines: 256 keys of 125 bytes per class), plus
hashing the prompt (~70 us for 4,096 tokens with xxh3) and a few big-int ANDs per block
and class.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsvc.cluster.hashing import PromptHasher
from kvsvc.cluster.layout import Keys
from kvsvc.cluster.store import Registry, Tracking, read_registry, tracking_problem
from kvsvc.core.hashing import HashingContext
from kvsvc.errors import InvalidArgument

_log = logging.getLogger("kvsvc.cluster")

# How old the cached registry may be before a Score reads it again, seconds: a source
# indexed (or purged) since shows up (or goes) within this long.
REGISTRY_MAX_AGE_S = 1.0
# Longest prompt Score takes, tokens (a server's max_model_len is its own bound; the
# scorer serves many engines, so it has a fixed one).
MAX_SCORE_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Attributes:
    scores: engine name -> cached prefix tokens, every indexed engine (or every
        candidate asked for that is indexed).
    num_blocks_read: block keys read from Redis.
    seed_mismatch: engines whose servers hash with another seed than the scorer (their
        scores are 0 whatever they cache: configure the same --hash-seed-file).
    upper_bound: engines with groups the index does not track (Mamba, chunked local or
        cross attention, ...): their scores may exceed what their Lookup answers.
    """

    scores: dict[str, int]
    num_blocks_read: int
    seed_mismatch: tuple[str, ...] = ()
    upper_bound: tuple[str, ...] = ()


# Most block hashes a prompt may be given as (a 2^20-token prompt in blocks of 16), and
# their longest (sha256: 32 bytes).
MAX_PROMPT_HASHES = 1 << 16
MAX_HASH_BYTES = 64


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt as token ids (and hashing context): hashed here as the engines hash it."""

    token_ids: Sequence[int]
    hashing: HashingContext | None = None
    full_attention_only = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def check(self) -> None:
        if len(self.token_ids) > MAX_SCORE_TOKENS:
            raise InvalidArgument(
                "token_ids",
                f"{len(self.token_ids)} tokens exceed the limit of {MAX_SCORE_TOKENS}",
            )

    def block_hashes(
        self,
        hasher: Callable[[str], PromptHasher],
        algo: str,
        hash_block_size: int,
        block_size: int,
    ) -> list[bytes] | None:
        return hasher(algo).block_hashes(self.token_ids, hash_block_size, block_size, self.hashing)


@dataclass(frozen=True, slots=True)
class HashesPrompt:
    """A prompt as the chained hashes of its full blocks of ``block_size`` tokens, as the
    engines index them (computed by the caller with the cluster's algorithm and seed).
    Engines indexed at another block size, or with sliding-window groups (whose windows
    need hashes the caller did not send), count nothing cached."""

    hashes: Sequence[bytes]
    block_size: int
    num_tokens: int
    full_attention_only = True

    def check(self) -> None:
        if not 1 <= self.block_size <= MAX_SCORE_TOKENS:
            raise InvalidArgument(
                "block_size", f"must be in [1, {MAX_SCORE_TOKENS}] with block_hashes"
            )
        if len(self.hashes) > MAX_PROMPT_HASHES:
            raise InvalidArgument(
                "block_hashes", f"{len(self.hashes)} hashes exceed the limit of {MAX_PROMPT_HASHES}"
            )
        for i, h in enumerate(self.hashes):
            if not 1 <= len(h) <= MAX_HASH_BYTES:
                raise InvalidArgument(
                    f"block_hashes[{i}]", f"{len(h)} bytes (must be 1 to {MAX_HASH_BYTES})"
                )
        least = len(self.hashes) * self.block_size
        if not least <= self.num_tokens <= MAX_SCORE_TOKENS:
            raise InvalidArgument(
                "num_prompt_tokens",
                f"{self.num_tokens}: must be at least block_hashes x block_size ({least}) and "
                f"at most {MAX_SCORE_TOKENS}",
            )

    def block_hashes(
        self,
        hasher: Callable[[str], PromptHasher],
        algo: str,
        hash_block_size: int,
        block_size: int,
    ) -> list[bytes] | None:
        return list(self.hashes) if block_size == self.block_size else None


Prompt = TokenPrompt | HashesPrompt


# A tracked class as the scorer sees it: (window tokens, 0 for full attention; block size;
# whether it is the source's primary class, whose bitmaps are ``P:b:H``).
_Rule = tuple[int, int, bool]


@dataclass(slots=True)
class _Family:
    """Engines that hash a prompt alike and hit by the same rules, and where their bits
    are."""

    algo: str
    hash_block_size: int
    align: int  # every hit is a multiple of it (the lcm of the engines' block sizes)
    rules: tuple[_Rule, ...]  # the primary class first when there is one
    hash_bytes: int = 0  # the hashes' last bytes the blocks are indexed under (0: all)
    mask: int = 0  # every member's bit (bit i of the big-endian bitmap int)
    by_bit: dict[int, str] = field(default_factory=dict)

    @property
    def full_only(self) -> bool:
        """One full-attention class: the longest run of present blocks (today's path)."""
        return len(self.rules) == 1 and self.rules[0][0] == 0


@dataclass(frozen=True, slots=True)
class _Plan:
    names: list[str]
    families: list[_Family]
    mismatch: tuple[str, ...]
    width: int  # bitmap bytes read per block
    upper_bound: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PreparedScore:
    """A score between :meth:`Scorer.prepare` and :meth:`Scorer.finish`: the engines to
    score and, in ``order``, the bitmap keys to read (each once)."""

    plan: _Plan
    scores: dict[str, int]
    families: list[_Family]
    keys_of: list[list[list[bytes]]]
    order: list[bytes]
    max_tokens: int = 0


def _window_ands(present: Sequence[int], window_blocks: int) -> list[int]:
    """``out[k]`` = AND of ``present[max(0, k - window_blocks):k]`` for k in 0..len
    (``out[0]`` = -1, every bit), in three ANDs per block whatever the window: the blocks
    are cut in runs of ``window_blocks``, and a window is the suffix of one run and the
    prefix of the next (van Herk / Gil-Werman)."""
    size = len(present)
    n = window_blocks
    out = [-1] * (size + 1)
    acc = -1
    for k in range(min(n, size)):
        acc &= present[k]
        out[k + 1] = acc
    if n >= size:
        return out
    head = [0] * size  # AND from the start of k's run up to k
    tail = [0] * size  # AND from k to the end of its run
    for start in range(0, size, n):
        stop = min(start + n, size)
        acc = -1
        for k in range(start, stop):
            acc &= present[k]
            head[k] = acc
        acc = -1
        for k in range(stop - 1, start - 1, -1):
            acc &= present[k]
            tail[k] = acc
    for k in range(n + 1, size + 1):
        out[k] = tail[k - n] & head[k - 1]
    return out


class Scorer:
    """Scores prompts against the index in Redis. Thread-safe.

    Args:
        client: a Redis or RedisCluster client.
        hash_seed: the cluster's seed (the servers' ``--hash-seed-file``); None for
            ``sha256_cbor`` servers that kept its public default.
        keys: the key layout (its prefix).
    """

    def __init__(self, client: object, hash_seed: str | None, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self.hash_seed = hash_seed
        self._hashers: dict[str, PromptHasher] = {}
        self._registry: Registry | None = None
        self._registry_at = 0.0
        self._lock = threading.Lock()
        self._invalid_said: set[str] = set()  # engines whose bad entry was logged

    def _hasher(self, algo: str) -> PromptHasher:
        hasher = self._hashers.get(algo)
        if hasher is None:
            hasher = self._hashers[algo] = PromptHasher(algo, self.hash_seed)
        return hasher

    def registry(self, max_age: float = REGISTRY_MAX_AGE_S) -> Registry:
        """The indexed engines, re-read when older than ``max_age`` seconds."""
        now = time.monotonic()
        with self._lock:
            if self._registry is not None and now - self._registry_at < max_age:
                return self._registry
        registry = read_registry(self.client, self.keys)
        with self._lock:
            self._registry, self._registry_at = registry, now
        return registry

    def score(
        self,
        token_ids: Sequence[int],
        hashing: HashingContext | None = None,
        engines: Collection[str] | None = None,
        max_registry_age: float = REGISTRY_MAX_AGE_S,
    ) -> ScoreResult:
        """Cached prefix tokens of ``token_ids`` per engine.

        Args:
            token_ids: the prompt, each id in [0, 2^31).
            hashing: its hashing context (salt, LoRA, multimodal items), as the engines'
                admissions would give it.
            engines: only these engines (names as indexed; unknown names are left out);
                None: every indexed engine.
            max_registry_age: seconds the cached list of engines may be old.

        Raises:
            InvalidArgument: a prompt over MAX_SCORE_TOKENS, a bad token id or
                multimodal item, or an ``xxh3_128`` index without a seed.
        """
        prepared = self.prepare(TokenPrompt(token_ids, hashing), engines, max_registry_age)
        values = self._read_bitmaps(prepared.order) if prepared.order else []
        return self.finish(prepared, values)

    def prepare(
        self,
        prompt: Prompt,
        engines: Collection[str] | None = None,
        max_registry_age: float = REGISTRY_MAX_AGE_S,
        registry: Registry | None = None,
    ) -> PreparedScore:
        """The first half of a score: the engines to score and the bitmap keys to read
        (:meth:`finish` is the second; a caller that reads more in the same round trip,
        as Route reads the engines' loads, reads ``order`` itself).

        Args:
            registry: the engines as read (None: :meth:`registry`, at most
                ``max_registry_age`` old); a caller that needs the same read after
                passes it.

        Raises:
            InvalidArgument: see :meth:`score`; for block hashes, a bad count, size or
                block size.
        """
        prompt.check()
        if registry is None:
            registry = self.registry(max_registry_age)
        plan = self._plan(registry, engines)
        scores = dict.fromkeys(plan.names, 0)
        num_tokens = prompt.num_tokens
        if num_tokens < 2 or not plan.families:
            return PreparedScore(plan, scores, [], [], [])
        max_tokens = num_tokens - 1  # >= 1 token left to compute, as Lookup caps it
        hashed: dict[tuple[str, int, int], list[bytes] | None] = {}
        # Per family, per rule: the bitmap keys of the blocks a hit can use.
        families: list[_Family] = []
        keys_of: list[list[list[bytes]]] = []
        wanted: dict[bytes, None] = {}
        for family in plan.families:
            family_keys = []
            for window, block_size, primary in family.rules:
                source = (family.algo, family.hash_block_size, block_size)
                if source not in hashed:
                    hashed[source] = prompt.block_hashes(
                        self._hasher, family.algo, family.hash_block_size, block_size
                    )
                hashes = hashed[source]
                if hashes is None or (prompt.full_attention_only and not family.full_only):
                    break  # the prompt cannot be scored for this family: nothing cached
                if family.full_only:
                    count = max_tokens // block_size
                else:  # up to the longest aligned hit
                    count = max_tokens // family.align * family.align // block_size
                if primary:
                    prefix = self.keys.block(b"")
                else:
                    prefix = self.keys.class_block(window, block_size, b"")
                cut = -family.hash_bytes if family.hash_bytes else 0
                rule_keys = [prefix + h[cut:] for h in hashes[:count]]
                family_keys.append(rule_keys)
            else:
                families.append(family)
                keys_of.append(family_keys)
                for rule_keys in family_keys:
                    wanted.update(dict.fromkeys(rule_keys))
        return PreparedScore(plan, scores, families, keys_of, list(wanted), max_tokens)

    def finish(self, prepared: PreparedScore, values: Sequence[bytes | None]) -> ScoreResult:
        """The scores from the bitmaps read for ``prepared.order`` (in that order)."""
        plan, scores = prepared.plan, prepared.scores
        width = plan.width
        bitmaps = {
            key: int.from_bytes(raw[:width].ljust(width, b"\0"), "big")
            for key, raw in zip(prepared.order, values, strict=True)
            if raw
        }
        for family, family_keys in zip(prepared.families, prepared.keys_of, strict=True):
            present = [[bitmaps.get(key, 0) for key in rule_keys] for rule_keys in family_keys]
            if family.full_only:
                self._score_run(family, present[0], scores)
            else:
                self._score_rules(family, present, prepared.max_tokens // family.align, scores)
        return ScoreResult(scores, len(prepared.order), plan.mismatch, plan.upper_bound)

    @staticmethod
    def _score_run(family: _Family, present: list[int], scores: dict[str, int]) -> None:
        """Full attention alone: an engine's hit is the block at which its bit first
        drops out (one big-int AND per block, stopping once no engine is left)."""
        block_size = family.rules[0][1]
        align = family.align
        alive = family.mask
        # (tokens, engines' bits) per block where some engines' runs end.
        ends: list[tuple[int, int]] = []
        blocks = 0
        for bits in present:
            still = alive & bits
            if still != alive:
                ends.append((blocks * block_size, alive ^ still))
                alive = still
                if not alive:
                    break
            blocks += 1
        if alive:
            ends.append((blocks * block_size, alive))
        by_bit = family.by_bit
        for tokens, bits in ends:
            tokens = tokens // align * align  # untracked groups' block sizes still align
            if not tokens:
                continue
            while bits:
                low = bits & -bits
                scores[by_bit[low.bit_length() - 1]] = tokens
                bits ^= low

    @staticmethod
    def _score_rules(
        family: _Family, present: list[list[int]], max_hits: int, scores: dict[str, int]
    ) -> None:
        """The hybrid rule (the server's ``HybridCoordinator.find_longest_cache_hit``):
        the hit is the longest length ``m * align`` (at most ``max_hits`` aligns) that
        every class accepts. A full-attention class accepts it while its first
        ``m * align / block_size`` blocks are all present; a sliding-window class while
        the ``cdiv(window - 1, block_size)`` blocks before it are (all of them, from
        block 0, when there are fewer). Each class's acceptance is a bitmap per length
        (prefix ANDs; windowed ANDs in three ANDs per block), and the lengths are tried
        longest first, each engine taking the first that all its classes accept."""
        align = family.align
        bound = max_hits
        # Per class: (blocks per align, acceptance bitmaps indexed by block count).
        accept: list[tuple[int, list[int]]] = []
        windowed: list[tuple[int, int, list[int]]] = []
        for (window, block_size, _), bits in zip(family.rules, present, strict=True):
            step = align // block_size
            needed = max(1, -(-(window - 1) // block_size)) if window else 0
            if window and needed < len(bits):
                windowed.append((step, needed, bits))
                continue
            # A prefix rule (full attention, or a window wider than the prompt): stop
            # where no engine is left; no longer hit is possible past that.
            ands = [-1]
            alive = family.mask
            for value in bits:
                alive &= value
                if not alive:
                    break
                ands.append(alive)
            bound = min(bound, (len(ands) - 1) // step)
            accept.append((step, ands))
        if bound <= 0:
            return
        for step, needed, bits in windowed:
            accept.append((step, _window_ands(bits[: bound * step], needed)))
        remaining = family.mask
        by_bit = family.by_bit
        for hits in range(bound, 0, -1):
            found = remaining
            for step, ands in accept:
                found &= ands[hits * step]
                if not found:
                    break
            if not found:
                continue
            tokens = hits * align
            remaining ^= found
            while found:
                low = found & -found
                scores[by_bit[low.bit_length() - 1]] = tokens
                found ^= low
            if not remaining:
                break

    def _plan(self, registry: Registry, engines: Collection[str] | None) -> _Plan:
        """The engines to score, grouped by how they hash and hit (cached per registry
        read for the common case of every engine)."""
        if engines is None and registry.plan is not None:
            return registry.plan  # type: ignore[no-any-return]
        chosen = {
            name: value
            for name, value in registry.engines.items()
            if engines is None or name in engines
        }
        width = registry.max_id // 8 + 1
        top = width * 8 - 1
        families: dict[tuple[str, int, int, tuple[_Rule, ...], int], _Family] = {}
        mismatch: list[str] = []
        upper_bound: list[str] = []
        for name, (_, tracking) in list(chosen.items()):
            problem = tracking_problem(tracking)
            if problem is not None:
                # Written by an indexer that did not check (or by hand): that engine is
                # left out, every other one is scored.
                del chosen[name]
                if name not in self._invalid_said:
                    self._invalid_said.add(name)
                    _log.warning("engine %s is not scored: its index entry has %s", name, problem)
        for name, (engine_id, tracking) in chosen.items():
            rules = _rules(tracking)
            if not rules:
                continue  # nothing tracked (no attention group it can follow): no hit
            hasher = self._hasher(tracking.hash_algo)
            if tracking.fingerprint and tracking.fingerprint != hasher.fingerprint:
                mismatch.append(name)
                continue
            if not tracking.exact:
                upper_bound.append(name)
            key = (
                tracking.hash_algo,
                tracking.hash_block_size,
                tracking.align,
                rules,
                tracking.hash_bytes,
            )
            family = families.get(key)
            if family is None:
                family = families[key] = _Family(*key)
            bit = top - engine_id
            family.mask |= 1 << bit
            family.by_bit[bit] = name
        if mismatch:
            _log.warning(
                "%d %s with another seed than this scorer (e.g. %s): scored 0",
                len(mismatch),
                "engine hashes" if len(mismatch) == 1 else "engines hash",
                mismatch[0],
            )
        plan = _Plan(
            list(chosen), list(families.values()), tuple(mismatch), width, tuple(upper_bound)
        )
        if engines is None:
            registry.plan = plan
        return plan

    def _read_bitmaps(self, names: list[bytes]) -> list[bytes | None]:
        """The bitmaps in one MGET: on a cluster, one per slot, sent to all the nodes in
        one pipelined round (redis-py's ``mget_nonatomic``). One MGET costs a fraction of
        256 pipelined GETs in the client."""
        client: Any = self.client
        if hasattr(client, "mget_nonatomic"):
            return client.mget_nonatomic(names)  # type: ignore[no-any-return]
        return client.mget(names)  # type: ignore[no-any-return]


def _rules(tracking: Tracking) -> tuple[_Rule, ...]:
    """A source's tracked classes as scoring rules, the primary class first (the order
    only matters for speed: prefix rules bound the lengths the windows are tried at)."""
    rules: list[_Rule] = [(0, tracking.block_size, True)] if tracking.groups else []
    rules += sorted((c.window, c.block_size, False) for c in tracking.classes)
    return tuple(rules)


def tracking_summary(tracking: Tracking) -> str:
    """One line about how an engine is scored (for logs and ``ctl score``)."""
    parts = []
    if tracking.groups:
        parts.append(f"full attention groups {list(tracking.groups)}, block {tracking.block_size}")
    for c in tracking.classes:
        kind = f"window {c.window}" if c.window else "full attention"
        parts.append(f"{kind} groups {list(c.groups)}, block {c.block_size}")
    if tracking.untracked:
        parts.append(f"untracked groups {list(tracking.untracked)} (an upper bound)")
    if tracking.align != tracking.block_size:
        parts.append(f"aligned to {tracking.align}")
    parts.append(f"hash {tracking.hash_algo}/{tracking.hash_block_size}")
    if tracking.hash_bytes:
        parts.append(f"indexed by the hashes' last {tracking.hash_bytes} bytes (vLLM's int hashes)")
    return "; ".join(parts)
