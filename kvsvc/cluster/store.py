"""The cluster index in Redis: what an indexer writes for a source, and the registry.

:class:`SourceStore` is one source's writer (the layout and the two-step write are in
:mod:`kvsvc.cluster.layout`). It is used by one thread at a time; several processes may
hold SourceStores of the same source, and the lease decides which of them writes.

Redis clients: ``redis.Redis`` or ``redis.cluster.RedisCluster`` (see :func:`connect`),
both thread-safe (connection pools), so one client serves every source of a process.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import lcm
from typing import Any

from kvsvc.cluster import layout
from kvsvc.cluster.layout import FULL_ATTENTION_KINDS, SLIDING_WINDOW_KINDS, Keys

_log = logging.getLogger("kvsvc.cluster")

# Commands per pipeline when bits or staged fields are written in bulk (bounds the
# memory of one pipeline and the time Redis spends on one packet).
PIPELINE_CHUNK = 4096
# A writer's staged snapshot lives this long unless its install takes it in: what an
# indexer that died or lost its lease mid-install left behind goes away by itself (no
# install takes an hour; the script drops the TTL as it renames the stage in).
STAGE_TTL_MS = 3_600_000


def compact_ops(ops: Sequence[bytes]) -> list[bytes]:
    """The same change as ``ops`` with each hash's stores and removals summed between
    clears: a block stored and evicted within one run costs the script nothing, a run
    that catches up after a pause writes each hash once. (A removal of a hash the source
    did not hold is then netted against a later store instead of being counted apart:
    that only happens on a stream that lost events without a gap marker.)"""
    out: list[bytes] = []
    deltas: dict[bytes, int] = {}

    def flush() -> None:
        for field, delta in deltas.items():
            if delta == 1:
                out.append(b"S" + field)
            elif delta == -1:
                out.append(b"R" + field)
            elif delta:
                out.append(b"D" + field)
                out.append(str(delta).encode())
        deltas.clear()

    get = deltas.get
    for op in ops:
        kind = op[:1]
        if kind == b"C":
            flush()
            out.append(op)
            continue
        field = op[1:]
        deltas[field] = get(field, 0) + (1 if kind == b"S" else -1)
    flush()
    return out


class LeaseLost(Exception):
    """Another indexer holds the source's lease now: this one must stop writing it."""


class SourceMoved(Exception):
    """The source's stored epoch or sequence is not where the writer thought: resync."""


def connect(url: str, *, cluster: bool | None = None, timeout: float = 5.0) -> Any:
    """A Redis client for ``url`` (``redis://HOST:PORT[/DB]``, ``rediss://`` for TLS).

    Args:
        url: where Redis is; with ``cluster`` None a node that reports
            ``cluster_enabled:1`` gets a cluster client, which finds the other nodes.
        cluster: force a cluster (True) or a plain (False) client.
        timeout: socket timeout of each command, seconds.

    Raises:
        ValueError: a URL redis-py cannot parse (the message names it).
        redis.exceptions.ConnectionError: Redis cannot be reached (with ``cluster`` None).
    """
    import redis
    from redis.cluster import RedisCluster

    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--redis {url!r}: expected redis://HOST:PORT (or rediss://, unix://)")
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if cluster is None:
        probe = redis.Redis.from_url(url, **options)  # type: ignore[arg-type]
        try:
            cluster = bool(probe.info("cluster").get("cluster_enabled"))
        finally:
            probe.close()
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)  # type: ignore[arg-type]


def source_name(target: str, pool: str) -> str:
    """How a source is named in the index and in Score's answer: ``HOST:PORT/POOL``."""
    return f"{target}/{pool}"


def parse_source(text: str) -> tuple[str, str]:
    """``HOST:PORT/POOL`` (or ``unix:PATH/POOL``) -> (target, pool).

    Raises:
        ValueError: no ``/POOL``, an empty pool, or a target without ``:``.
    """
    target, slash, pool = text.strip().rpartition("/")
    if not slash or not pool or not target or ":" not in target:
        raise ValueError(f"source {text!r}: expected HOST:PORT/POOL")
    if any(c in pool for c in "{}") or any(c in target for c in "{}"):
        raise ValueError(f"source {text!r}: '{{' and '}}' would break the Redis hash tags")
    return target, pool


@dataclass(frozen=True, slots=True)
class TrackedClass:
    """Groups of a source that hit by one rule, beside its primary class.

    Attributes:
        window: the groups' sliding window in tokens; 0 for full attention (groups of
            another block size than the primary class's).
        block_size: tokens per block of the groups.
        groups: the groups' indexes (a block is present while every one caches it).
    """

    window: int
    block_size: int
    groups: tuple[int, ...]


# What a source may claim about its blocks. A block of more tokens than the longest prompt
# Score takes (MAX_SCORE_TOKENS) never scores; 0 or a negative one broke every Score, of
# every engine (a division by zero, a negative count, an overflow in the bit arithmetic).
MAX_BLOCK_SIZE = 1 << 20
# Hash bytes (sha256: 32; xxh3_128: 16), and group indexes (one byte in the keys).
MAX_HASH_BYTES = 64
MAX_GROUP_INDEX = 255
MAX_WINDOW = 1 << 31


class InvalidSource(Exception):
    """A source sent what the index cannot hold (a block size of 0, a negative or huge
    one, a group index past a byte, an oversized hash): it is quarantined, not indexed."""


def block_size_problem(block_size: object, what: str = "block_size") -> str | None:
    """Why ``block_size`` cannot be a block size in the index (None: it can)."""
    if type(block_size) is not int or not 1 <= block_size <= MAX_BLOCK_SIZE:
        return f"{what} {block_size!r} (must be an integer in [1, {MAX_BLOCK_SIZE}])"
    return None


def tracking_problem(tracking: Tracking) -> str | None:
    """Why the index cannot score a source tracked as ``tracking`` (None: it can)."""
    problem = (
        block_size_problem(tracking.block_size)
        or block_size_problem(tracking.hash_block_size, "hash_block_size")
        or block_size_problem(tracking.align, "align")
    )
    if problem is None and tracking.block_size % tracking.hash_block_size:
        problem = (
            f"block_size {tracking.block_size} is not a multiple of hash_block_size "
            f"{tracking.hash_block_size}"
        )
    for c in tracking.classes:
        problem = problem or block_size_problem(c.block_size, "a class's block_size")
        if problem is None and not 0 <= c.window <= MAX_WINDOW:
            problem = f"sliding window {c.window} (must be in [0, {MAX_WINDOW}])"
    groups = [*tracking.groups, *(g for c in tracking.classes for g in c.groups)]
    bad = [g for g in groups if not 0 <= g <= MAX_GROUP_INDEX]
    if problem is None and bad:
        problem = f"group index {bad[0]} (must be in [0, {MAX_GROUP_INDEX}])"
    return problem


@dataclass(slots=True)
class Tracking:
    """Which of a source's groups the index tracks, in which class, and how its prompts
    hash (layout.py's docstring has the classes).

    Attributes:
        groups: the primary class's groups (full-attention kinds of one block size; empty
            for a model without full attention). Kept apart, and first in the meta, so
            that an older scorer reading the registry still scores the full-attention
            part of a hybrid model (an upper bound) rather than failing.
        block_size: tokens per block of the primary class (the hash block size without
            one).
        hash_block_size: tokens per hash block of the pool.
        hash_algo / fingerprint: the pool's hash algorithm and seed fingerprint.
        medium: where the pool's blocks live.
        classes: the other tracked classes (sliding windows, full attention of another
            block size), each with its own bitmaps.
        align: tokens every hit is a multiple of: the lcm of all the pool's groups' block
            sizes, tracked or not (the server aligns to it); 0: ``block_size``.
        untracked: groups of kinds the index cannot follow (Mamba, chunked local, cross
            attention, ...): with any, a score is an upper bound of the engine's Lookup.
        legacy: read from a meta written before classes existed (full attention only);
            the indexer snapshots such a source again to learn its windows.
        hash_bytes: 0: blocks are indexed under their whole hash; 8: under its last 8
            bytes, the 64-bit int vLLM publishes by default (a ZMQ source whose engine
            sends int hashes): the scorer looks a prompt's hashes up the same way.
    """

    groups: tuple[int, ...]
    block_size: int
    hash_block_size: int
    hash_algo: str
    fingerprint: str
    medium: str = "GPU"
    classes: tuple[TrackedClass, ...] = ()
    align: int = 0
    untracked: tuple[int, ...] = ()
    legacy: bool = False
    hash_bytes: int = 0

    def __post_init__(self) -> None:
        if self.align <= 0:
            self.align = self.block_size

    @property
    def tracked_groups(self) -> frozenset[int]:
        """Every group whose events the index applies."""
        return frozenset(self.groups).union(*(c.groups for c in self.classes))

    @property
    def exact(self) -> bool:
        """Whether the score is the engine's Lookup (no group left untracked)."""
        return not self.untracked

    def class_prefixes(self, keys: Keys) -> list[tuple[bytes, str, tuple[int, ...]]]:
        """Per tracked class: its bitmaps' key prefix, its pending form ("h": the primary
        class, "k": another; see layout.APPLY) and its groups."""
        out = [(keys.block(b""), "h", self.groups)] if self.groups else []
        out += [
            (keys.class_block(c.window, c.block_size, b""), "k", c.groups) for c in self.classes
        ]
        return out

    @classmethod
    def from_groups(
        cls,
        groups: Iterable[tuple[int, str, int] | tuple[int, str, int, int]],
        hash_block_size: int,
        hash_algo: str,
        fingerprint: str,
        medium: str = "GPU",
    ) -> Tracking:
        """From the pool's ``(index, kind, block size[, sliding window])`` groups: the
        primary class is the full-attention groups of the first such group's block size;
        every other (window, block size) of a full-attention or sliding-window group is a
        class of its own. A sliding-window group without its window (a server older than
        IndexGroup.sliding_window) and groups of other kinds are left untracked."""
        listed = [(int(g[0]), str(g[1]), int(g[2]), int(g[3]) if len(g) > 3 else 0) for g in groups]
        full = [(i, size) for i, kind, size, _ in listed if kind in FULL_ATTENTION_KINDS]
        size = full[0][1] if full else hash_block_size
        primary = tuple(i for i, s in full if s == size)
        by_class: dict[tuple[int, int], list[int]] = {}
        untracked: list[int] = []
        for index, kind, block_size, window in listed:
            if kind in FULL_ATTENTION_KINDS:
                if block_size != size:
                    by_class.setdefault((0, block_size), []).append(index)
            elif kind in SLIDING_WINDOW_KINDS and window > 0:
                by_class.setdefault((window, block_size), []).append(index)
            else:
                untracked.append(index)
        classes = tuple(TrackedClass(w, b, tuple(g)) for (w, b), g in by_class.items())
        align = lcm(*(b for _, _, b, _ in listed)) if listed else size
        return cls(
            primary, size, hash_block_size, hash_algo, fingerprint, medium,
            classes, align, tuple(untracked),
        )  # fmt: skip

    def to_meta(self) -> dict[str, str]:
        return {
            "groups": ",".join(map(str, self.groups)),
            "block_size": str(self.block_size),
            "hash_block_size": str(self.hash_block_size),
            "hash_algo": self.hash_algo,
            "fingerprint": self.fingerprint,
            "medium": self.medium,
            # WINDOW:BLOCK_SIZE:GROUP,GROUP;... (absent from a meta of before classes)
            "classes": ";".join(
                f"{c.window}:{c.block_size}:{','.join(map(str, c.groups))}" for c in self.classes
            ),
            "align": str(self.align),
            "untracked": ",".join(map(str, self.untracked)),
            "hash_bytes": str(self.hash_bytes),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, str]) -> Tracking:
        """From a source's meta or registry entry; one written before classes existed
        (no ``align``) is its full-attention groups alone, marked ``legacy``.

        Raises:
            ValueError: a malformed ``classes`` field (the message quotes it).
        """

        def ints(text: str) -> tuple[int, ...]:
            return tuple(int(g) for g in text.split(",") if g)

        classes = []
        for part in filter(None, meta.get("classes", "").split(";")):
            window, _, rest = part.partition(":")
            block_size, _, groups = rest.partition(":")
            if not window.isdigit() or not block_size.isdigit() or not groups:
                raise ValueError(f"tracked class {part!r}: expected WINDOW:BLOCK_SIZE:GROUPS")
            classes.append(TrackedClass(int(window), int(block_size), ints(groups)))
        return cls(
            ints(meta.get("groups", "")),
            int(meta["block_size"]),
            int(meta["hash_block_size"]),
            meta["hash_algo"],
            meta.get("fingerprint", ""),
            meta.get("medium", "GPU"),
            tuple(classes),
            int(meta.get("align", "0")),
            ints(meta.get("untracked", "")),
            legacy="align" not in meta,
            hash_bytes=int(meta.get("hash_bytes", "0")),
        )


@dataclass(slots=True)
class SourceState:
    """Where a source's index stands in Redis (None fields: never indexed, or purged)."""

    epoch: str | None = None
    seq: int = 0
    tracking: Tracking | None = None


@dataclass(slots=True)
class ApplyResult:
    """What one apply did: bits changed and removals of hashes that were not there."""

    flips: int = 0
    missing: int = 0
    duplicate: bool = False


@dataclass(slots=True)
class Registry:
    """The indexed engines: name -> (engine id, tracking), as read from Redis."""

    engines: dict[str, tuple[int, Tracking]] = field(default_factory=dict)
    plan: Any = None  # the scorer's grouping of these engines, made on first use

    @property
    def max_id(self) -> int:
        return max((i for i, _ in self.engines.values()), default=-1)


def read_registry(client: Any, keys: Keys) -> Registry:
    """Every indexed source with its id and tracking (one HGETALL on one slot)."""
    registry = Registry()
    for name, raw in client.hgetall(keys.sources).items():
        info = json.loads(raw)
        registry.engines[name.decode()] = (int(info["id"]), Tracking.from_meta(info))
    return registry


def _decode(meta: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in meta.items()}


class SourceStore:
    """One source's index in Redis, written by whoever holds its lease.

    Args:
        client: a Redis (or RedisCluster) client.
        name: the source's name (``HOST:PORT/POOL``).
        owner: this writer's lease token (unique per indexer process and source).
        keys: the key layout (its prefix).
        lease_ttl_s: how long a lease lasts without renewal; its holder renews it every
            third of that (:class:`kvsvc.cluster.lease.LeaseKeeper`). Another indexer takes
            over a source this long after its holder stopped.
    """

    def __init__(
        self, client: Any, name: str, owner: str, keys: Keys, lease_ttl_s: float = 10.0
    ) -> None:
        self.client = client
        self.name = name
        self.owner = owner
        self.keys = keys
        self.lease_ttl_ms = max(100, int(lease_ttl_s * 1000))
        self._keys = keys.source_keys(name, owner)
        self._apply = client.register_script(layout.APPLY)
        self._install = client.register_script(layout.INSTALL)
        self._clear_pending = client.register_script(layout.CLEAR_PENDING)
        self._lease = client.register_script(layout.LEASE)
        self._renew = client.register_script(layout.RENEW)
        self._release = client.register_script(layout.RELEASE)
        self._clear_bit = client.register_script(layout.CLEAR_BIT)
        self.engine_id: int | None = None
        # A cluster client: block keys are elsewhere, bits go in the two-step write.
        self.clustered = hasattr(client, "get_node_from_key")

    # -- the lease -----------------------------------------------------------------------

    def acquire(self) -> str:
        """Take or renew the lease: ``"new"`` (just taken), ``"ok"`` (renewed) or
        ``"held"`` (another indexer has it)."""
        result = self._lease(keys=self._keys, args=[self.owner, self.lease_ttl_ms])
        status = result.decode() if isinstance(result, bytes) else str(result)
        if status == "new":
            # A lease taken afresh may mean Redis lost everything (a restart without
            # persistence), the id registry included: an id remembered from before could
            # be handed to another source now, and both would write the same bit.
            self.engine_id = None
        return status

    def renew(self) -> bool:
        """Extend the lease this writer holds; False when it is gone or another's (it is
        then not taken: the writer takes it again with :meth:`acquire`)."""
        result = self._renew(keys=self._keys, args=[self.owner, self.lease_ttl_ms])
        return (result.decode() if isinstance(result, bytes) else str(result)) == "ok"

    def release(self) -> None:
        self._release(keys=self._keys, args=[self.owner])

    # -- reading -------------------------------------------------------------------------

    def state(self) -> SourceState:
        meta = _decode(self.client.hgetall(self._keys[0]))
        if "epoch" not in meta:
            return SourceState()
        tracking = Tracking.from_meta(meta) if "block_size" in meta else None
        return SourceState(meta["epoch"], int(meta.get("seq", "0")), tracking)

    def counts(self) -> dict[bytes, int]:
        """group byte + hash -> blocks, as stored (HSCAN: never one huge reply)."""
        return {bytes(k): int(v) for k, v in self.client.hscan_iter(self._keys[1], count=4096)}

    # -- writing -------------------------------------------------------------------------

    def ensure_id(self) -> int:
        """The source's engine id (its bit in every block bitmap), taken from the registry
        or handed out on first use; two indexers racing for a new source agree on one."""
        if self.engine_id is not None:
            return self.engine_id
        found = self.client.hget(self.keys.ids, self.name)
        if found is None:
            candidate = int(self.client.incr(self.keys.next_id)) - 1
            self.client.hsetnx(self.keys.ids, self.name, candidate)
            found = self.client.hget(self.keys.ids, self.name)  # whoever won the race
        self.engine_id = int(found)
        return self.engine_id

    def _pending_entry(self, key: bytes, bit: int) -> tuple[bytes, str]:
        """A bit to write as its ``pending`` field and value (layout.APPLY's forms)."""
        primary = self.keys.block(b"")
        if key.startswith(primary):
            return key[len(primary) :], str(bit)
        return key, f"k{bit}"

    def _pending_bit(self, field: bytes, value: bytes) -> tuple[bytes, int]:
        """A ``pending`` field and value (or a flip the script returned) as (bitmap key,
        bit): "0"/"1" name a hash of the primary class (so an older indexer's entries
        read the same), "k0"/"k1" a whole key of another class."""
        if value[:1] == b"k":
            return field, int(value[1:])
        return self.keys.block(field), int(value)

    def _write_bits(self, bits: Sequence[tuple[bytes, int]]) -> None:
        """Set the source's bit in each bitmap key (absolute values: a repeat is
        harmless)."""
        engine = self.ensure_id()
        for start in range(0, len(bits), PIPELINE_CHUNK):
            chunk = bits[start : start + PIPELINE_CHUNK]
            if not self.clustered:
                pipe = self.client.pipeline(transaction=False)
                for key, bit in chunk:
                    if bit:
                        pipe.setbit(key, engine, 1)
                    else:  # the last bit of a block takes its key with it
                        self._clear_bit(keys=[key], args=[engine], client=pipe)
                pipe.execute()
                continue
            self._write_bits_cluster(list(chunk), engine)

    def _write_bits_cluster(self, bits: list[tuple[bytes, int]], engine: int) -> None:
        """The cluster form: redis-py refuses scripts in a cluster pipeline, so the keys
        are grouped by the node that serves their slot and each node gets a plain
        pipeline; a key that moved meanwhile (resharding) is written on its own through
        the cluster client, which follows the redirection."""
        import redis

        by_node: dict[str, tuple[Any, list[tuple[bytes, int]]]] = {}
        for key, bit in bits:
            node = self.client.get_node_from_key(key)
            by_node.setdefault(node.name, (node, []))[1].append((key, bit))
        for node, items in by_node.values():
            pipe = node.redis_connection.pipeline(transaction=False)
            for key, bit in items:
                if bit:
                    pipe.setbit(key, engine, 1)
                else:
                    pipe.eval(layout.CLEAR_BIT, 1, key, engine)
            replies = pipe.execute(raise_on_error=False)
            for (key, bit), reply in zip(items, replies, strict=True):
                if isinstance(reply, redis.exceptions.ResponseError):
                    if bit:
                        self.client.setbit(key, engine, 1)
                    else:
                        self._clear_bit(keys=[key], args=[engine])

    def _check(self, status: Any) -> None:
        if (status.decode() if isinstance(status, bytes) else status) == "lease":
            raise LeaseLost(self.name)

    def flush_pending(self) -> int:
        """Write the bits a previous writer decided but may not have written (after a
        takeover or an error), then clear them. Returns how many there were."""
        pending = [
            self._pending_bit(bytes(f), bytes(v))
            for f, v in self.client.hscan_iter(self._keys[2], count=PIPELINE_CHUNK)
        ]
        if pending:
            self._write_bits(pending)
        self._check(self._clear_pending(keys=self._keys, args=[self.owner]))
        return len(pending)

    def apply(
        self, epoch: str, first_seq: int, last_seq: int, tracking: Tracking, ops: Sequence[bytes]
    ) -> ApplyResult:
        """Apply batches ``first_seq..last_seq`` (their ops, in order) and write the bits
        that changed.

        Args:
            epoch / first_seq / last_seq: the batches' epoch and sequence range.
            tracking: the source's tracked classes (ops of other groups are counted but
                set no bit; the indexer leaves them out).
            ops: ``b"S" + group byte + hash``, ``b"R" + group byte + hash`` or ``b"C"``.

        Raises:
            LeaseLost: another indexer holds the lease.
            SourceMoved: the stored epoch is another, or a batch before ``first_seq`` was
                never applied (resync from a snapshot).
        """
        inline = -1 if self.clustered else self.ensure_id()
        classes = tracking.class_prefixes(self.keys)
        args: list[Any] = [self.owner, epoch, first_seq, last_seq, inline, len(classes)]
        for prefix, form, groups in classes:
            args += [prefix, form, len(groups), *(bytes([g]) for g in groups)]
        args.extend(compact_ops(ops))
        reply = self._apply(keys=self._keys, args=args)
        status = reply[0].decode()
        if status == "lease":
            raise LeaseLost(self.name)
        if status == "dup":
            return ApplyResult(duplicate=True)
        if status in ("epoch", "gap"):
            raise SourceMoved(f"{self.name}: stored {status} differs from batch {first_seq}")
        missing, changed = (int(x) for x in reply[1].split(b":"))
        flips = [
            self._pending_bit(bytes(reply[i]), bytes(reply[i + 1])) for i in range(2, len(reply), 2)
        ]
        if flips:
            self._write_bits(flips)
        return ApplyResult(flips=changed, missing=missing)

    def install(self, epoch: str, seq: int, tracking: Tracking, counts: dict[bytes, int]) -> int:
        """Replace the source's index with a snapshot's (``counts``: group byte + hash ->
        blocks, tracked groups only) at ``seq`` of ``epoch``; write the bits that change.

        Returns:
            The number of bits changed.

        Raises:
            LeaseLost: another indexer holds the lease.
            InvalidSource: ``tracking`` cannot be scored (nothing written).
        """
        problem = tracking_problem(tracking)
        if problem is not None:
            raise InvalidSource(problem)
        self.flush_pending()
        # What is set now follows the tracking it was written under (another model's
        # classes, after a restart with another spec, or a meta of before classes).
        stored = self.state().tracking or tracking
        old = self._present(self.counts(), stored)
        new = self._present(counts, tracking)
        flips = [(h, 1) for h in new - old] + [(h, 0) for h in old - new]
        # Hashes present before and after keep their bit; a bit that was lost (Redis
        # restarted without the block keys) is rewritten too: every present bit is set.
        flips += [(h, 1) for h in new & old]
        stage, stage_pending = self._keys[4], self._keys[5]
        self.client.delete(stage, stage_pending)
        items = list(counts.items())
        for start in range(0, len(items), PIPELINE_CHUNK):
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(stage, mapping=dict(items[start : start + PIPELINE_CHUNK]))
            pipe.pexpire(stage, STAGE_TTL_MS)
            pipe.execute()
        self._stage_pending(flips)
        meta = {"epoch": epoch, "seq": str(seq), **tracking.to_meta(), "updated": f"{time.time()}"}
        args: list[Any] = [self.owner]
        for key, value in meta.items():
            args += [key, value]
        self._check(self._install(keys=self._keys, args=args))
        self.flush_pending()
        engine = self.ensure_id()
        info = {"id": engine, **tracking.to_meta()}
        self.client.hset(self.keys.sources, self.name, json.dumps(info, sort_keys=True))
        return len(flips)

    def purge(self) -> int:
        """Drop the source from the index: its bits, counts and meta, and its registry
        entry (its engine id stays reserved for it). Returns the bits cleared.

        Raises:
            LeaseLost: another indexer holds the lease.
        """
        self.flush_pending()
        state = self.state()
        tracking = state.tracking or Tracking((0,), 1, 1, "", "")
        old = self._present(self.counts(), tracking)
        self.client.delete(self._keys[4], self._keys[5])
        flips = [(h, 0) for h in old]
        self._stage_pending(flips)
        self._check(self._install(keys=self._keys, args=[self.owner]))
        # Only once the script found the lease held: a purger that stalled past its lease
        # must not drop the new holder's entry (its engine would go unscored until its
        # next install).
        self.client.hdel(self.keys.sources, self.name)
        self.flush_pending()
        return len(flips)

    def _stage_pending(self, flips: Sequence[tuple[bytes, int]]) -> None:
        """Stage the bits an install or a purge changes (this writer's own stage key,
        expiring unless the install script takes it in)."""
        stage_pending = self._keys[5]
        for start in range(0, len(flips), PIPELINE_CHUNK):
            chunk = flips[start : start + PIPELINE_CHUNK]
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(stage_pending, mapping=dict(self._pending_entry(*f) for f in chunk))
            pipe.pexpire(stage_pending, STAGE_TTL_MS)
            pipe.execute()

    def _present(self, counts: dict[bytes, int], tracking: Tracking) -> set[bytes]:
        """The bitmap keys whose bit is set for these counts: per tracked class, the
        hashes with a block in every group of the class."""
        classes = tracking.class_prefixes(self.keys)
        class_of = {g: c for c, (_, _, groups) in enumerate(classes) for g in groups}
        by_hash: dict[tuple[int, bytes], int] = {}
        for key, count in counts.items():
            c = class_of.get(key[0])
            if count > 0 and c is not None:
                by_hash[c, key[1:]] = by_hash.get((c, key[1:]), 0) + 1
        return {classes[c][0] + h for (c, h), n in by_hash.items() if n >= len(classes[c][2])}
