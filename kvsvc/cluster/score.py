"""Score: per indexed engine, how many leading tokens of a prompt it has cached.

An engine's score is what its own ``Lookup`` answers for the prompt (full-attention
groups): the longest run of leading blocks whose hashes it caches in every tracked group,
capped so at least one token is left to compute, in tokens. Hashes come from
:class:`kvsvc.cluster.hashing.PromptHasher` (the servers' core code) once per distinct
``(hash algorithm, hash block size, block size)`` among the engines; all of a prompt's
block bitmaps are read in one pipelined round trip, then intersected in process: engine
``i``'s score is the block at which its bit first drops out, times its block size.

Cost: one Redis round trip (per node of a cluster) carrying ``blocks x bitmap bytes``
(a 4,096-token prompt over 1,000 engines: 256 keys of 125 bytes), plus hashing the prompt
(~70 us for 4,096 tokens with xxh3) and one big-int AND per block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsvc.cluster.hashing import PromptHasher
from kvsvc.cluster.layout import Keys
from kvsvc.cluster.store import Registry, Tracking, read_registry
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
    """

    scores: dict[str, int]
    num_blocks_read: int
    seed_mismatch: tuple[str, ...] = ()


@dataclass(slots=True)
class _Family:
    """Engines that hash a prompt alike, and where their bits are."""

    algo: str
    hash_block_size: int
    block_size: int
    mask: int = 0  # every member's bit (bit i of the big-endian bitmap int)
    by_bit: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Plan:
    names: list[str]
    families: list[_Family]
    mismatch: tuple[str, ...]
    width: int  # bitmap bytes read per block


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
        if len(token_ids) > MAX_SCORE_TOKENS:
            raise InvalidArgument(
                "token_ids", f"{len(token_ids)} tokens exceed the limit of {MAX_SCORE_TOKENS}"
            )
        registry = self.registry(max_registry_age)
        plan = self._plan(registry, engines)
        scores = dict.fromkeys(plan.names, 0)
        if len(token_ids) < 2 or not plan.families:
            return ScoreResult(scores, 0, plan.mismatch)
        hashes_of: list[list[bytes]] = []
        wanted: dict[bytes, None] = {}
        for family in plan.families:
            cap = (len(token_ids) - 1) // family.block_size  # >= 1 token left to compute
            hashes = self._hasher(family.algo).block_hashes(
                token_ids, family.hash_block_size, family.block_size, hashing
            )[:cap]
            hashes_of.append(hashes)
            wanted.update(dict.fromkeys(hashes))
        order = list(wanted)
        values = self._read_bitmaps(order) if order else []
        bitmaps = dict(zip(order, values, strict=True))
        width = plan.width
        zero = bytes(width)
        for family, hashes in zip(plan.families, hashes_of, strict=True):
            block_size = family.block_size
            alive = family.mask
            # (tokens, engines' bits) per block where some engines' runs end.
            ends: list[tuple[int, int]] = []
            blocks = 0
            for block_hash in hashes:
                raw = bitmaps[block_hash] or zero
                present = int.from_bytes(raw[:width].ljust(width, b"\0"), "big")
                still = alive & present
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
                if not tokens:
                    continue
                while bits:
                    low = bits & -bits
                    scores[by_bit[low.bit_length() - 1]] = tokens
                    bits ^= low
        return ScoreResult(scores, len(order), plan.mismatch)

    def _plan(self, registry: Registry, engines: Collection[str] | None) -> _Plan:
        """The engines to score, grouped by how they hash (cached per registry read for
        the common case of every engine)."""
        if engines is None and registry.plan is not None:
            return registry.plan  # type: ignore[no-any-return]
        chosen = {
            name: value
            for name, value in registry.engines.items()
            if engines is None or name in engines
        }
        width = registry.max_id // 8 + 1
        top = width * 8 - 1
        families: dict[tuple[str, int, int], _Family] = {}
        mismatch: list[str] = []
        for name, (engine_id, tracking) in chosen.items():
            if not tracking.groups:
                continue  # nothing tracked (no full-attention group): nothing to hit
            hasher = self._hasher(tracking.hash_algo)
            if tracking.fingerprint and tracking.fingerprint != hasher.fingerprint:
                mismatch.append(name)
                continue
            key = (tracking.hash_algo, tracking.hash_block_size, tracking.block_size)
            family = families.get(key)
            if family is None:
                family = families[key] = _Family(*key)
            bit = top - engine_id
            family.mask |= 1 << bit
            family.by_bit[bit] = name
        if mismatch:
            _log.warning(
                "%d engines hash with another seed than this scorer (e.g. %s): scored 0",
                len(mismatch),
                mismatch[0],
            )
        plan = _Plan(list(chosen), list(families.values()), tuple(mismatch), width)
        if engines is None:
            registry.plan = plan
        return plan

    def _read_bitmaps(self, hashes: list[bytes]) -> list[bytes | None]:
        """The blocks' bitmaps in one MGET: on a cluster, one per slot, sent to all the
        nodes in one pipelined round (redis-py's ``mget_nonatomic``). One MGET costs a
        fraction of 256 pipelined GETs in the client."""
        names = [self.keys.block(h) for h in hashes]
        client: Any = self.client
        if hasattr(client, "mget_nonatomic"):
            return client.mget_nonatomic(names)  # type: ignore[no-any-return]
        return client.mget(names)  # type: ignore[no-any-return]


def tracking_summary(tracking: Tracking) -> str:
    """One line about how an engine is scored (for logs and ``ctl score``)."""
    return (
        f"groups {list(tracking.groups)}, block {tracking.block_size}, hash "
        f"{tracking.hash_algo}/{tracking.hash_block_size}"
    )
