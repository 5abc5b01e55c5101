"""Engines' live load in the cluster index: what Route weighs beside the cached prefix.

The indexer that holds a source's lease asks its server's ``GetUsage`` every
``--load-interval`` seconds and writes the answer (running requests, blocks held by
requests, the pool's blocks) into one Redis string, the *load vector*, at the engine's
slot (its engine id x :data:`RECORD.size` bytes), stamped with Redis's own clock and the
report's TTL. Route reads the vector with the same round trip as the prompt's bitmaps
(:meth:`kvsvc.cluster.score.Scorer.score_and_read`), together with Redis's clock, and
counts a report older than its TTL as missing.

Why one string and not a key per engine with its own TTL: Route reads every candidate's
load on every call, and one ``GET`` of 24 bytes x engines (24 KB at 1,000 engines) costs
Redis and the client a fraction of an ``MGET`` of 1,000 keys. The TTL is kept per
report, in the report; the string as a whole expires ``KEY_TTL_FACTOR`` report TTLs after
the last write, so a fleet whose indexers are all gone leaves nothing behind.

Why Redis's clock: the indexer and the router run on different hosts; both stamps (the
write's and the read's) come from the same Redis, so no host clock has to agree with
another. On a Redis Cluster the vector lives in the registry's slot, and the router asks
that node for its time.

Loads are not fenced by the source's lease (it is in another slot): only the lease holder
polls, and a stale writer that lost its lease writes at most one stale report, which the
holder's next one replaces.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from kvsvc.cluster.layout import Keys

# One engine's report: Redis time in ms (a double: exact to 2^53), the report's TTL in ms,
# running requests, blocks held by requests, the pool's usable blocks.
RECORD = struct.Struct(">dIIII")
# How long the whole vector outlives its last write, in report TTLs.
KEY_TTL_FACTOR = 10
# Counts past this are clamped (the record's fields are 32-bit).
MAX_FIELD = (1 << 32) - 1

# KEYS: the load vector. ARGV: the engine's byte offset, the report's TTL (ms), running
# requests, used blocks, usable blocks, the vector's own TTL (ms). Stamps the report with
# Redis's clock in ms to the microsecond (so routers on other hosts compare it with the
# same clock, and a route made just before a report is never counted after it).
PUBLISH = r"""
local t = redis.call('TIME')
local ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
redis.call('SETRANGE', KEYS[1], ARGV[1],
  struct.pack('>dIIII', ms, tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
    tonumber(ARGV[5])))
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
"""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One engine's load as its server last reported it.

    Attributes:
        running: requests live on the pool (admitted and not freed).
        used_blocks: blocks held by requests.
        num_blocks: the pool's usable blocks.
        stamp_ms: when it was written, Redis's clock, ms.
        ttl_ms: how long it counts.
    """

    running: int
    used_blocks: int
    num_blocks: int
    stamp_ms: float
    ttl_ms: int

    def fresh(self, now_ms: float) -> bool:
        """Whether the report still counts at ``now_ms`` (Redis's clock)."""
        return self.stamp_ms > 0 and now_ms - self.stamp_ms <= self.ttl_ms


def redis_time_ms(reply: Any) -> float:
    """Redis ``TIME`` (seconds, microseconds) in ms."""
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) / 1000


def parse_vector(raw: bytes | None, engine_id: int) -> LoadReport | None:
    """Engine ``engine_id``'s report in the vector (None: never written)."""
    if not raw:
        return None
    offset = engine_id * RECORD.size
    if offset + RECORD.size > len(raw):
        return None
    stamp, ttl, running, used, total = RECORD.unpack_from(raw, offset)
    if stamp <= 0:
        return None
    return LoadReport(running, used, total, stamp, ttl)


class LoadPublisher:
    """Writes one engine's load reports (used by its indexer's follower, one thread).

    Args:
        client: a Redis or RedisCluster client.
        keys: the key layout.
        ttl_s: how long a report counts.
    """

    def __init__(self, client: Any, keys: Keys, ttl_s: float) -> None:
        self.client = client
        self.key = keys.load
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._publish = client.register_script(PUBLISH)

    def publish(self, engine_id: int, running: int, used_blocks: int, num_blocks: int) -> None:
        """Write the engine's report, stamped with Redis's clock."""
        values = [min(MAX_FIELD, max(0, v)) for v in (running, used_blocks, num_blocks)]
        self._publish(
            keys=[self.key],
            args=[engine_id * RECORD.size, self.ttl_ms, *values, self.ttl_ms * KEY_TTL_FACTOR],
        )
