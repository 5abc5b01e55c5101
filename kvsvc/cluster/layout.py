"""The cluster index's Redis key layout, and the Lua scripts that change it.

Keys (``P`` is the key prefix, ``kvsvc`` by default; ``S`` a source's name,
``HOST:PORT/POOL``; ``H`` a block hash, its raw bytes)::

    one slot, tag {P:registry}        the engines
      P:{P:registry}:ids              HASH   S -> engine id (a small int, never reused)
      P:{P:registry}:next_id          STRING the last id handed out
      P:{P:registry}:sources          HASH   S -> JSON of the indexed source (id, hashing
                                             settings, block size); the engines Score lists
      P:{P:registry}:load             STRING the engines' live load: 24 bytes per engine
                                             id (:mod:`kvsvc.cluster.load`), read by Route

    one slot per source, tag {P:src:S}  everything one indexer writes for one source
      P:{P:src:S}:meta                HASH   epoch, seq (the last batch applied), the
                                             tracked classes and their groups, block
                                             sizes, hashing settings
      P:{P:src:S}:blocks              HASH   group byte + H -> blocks the source caches
                                             under H in that group (duplicates counted)
      P:{P:src:S}:pending             HASH   H -> "0"/"1" (or key -> "k0"/"k1"): block
                                             bits decided but maybe not written yet
      P:{P:src:S}:lease               STRING the indexer that may write S (with a TTL)
      P:{P:src:S}:stage:O, :stage_pending:O  a snapshot indexer O (its lease token) is
                                             writing, renamed in at once (with a TTL
                                             until then)

    one slot per block hash and class (spread over the cluster; no hash tag)
      P:b:H                           STRING a bitmap over engine ids: bit i is set while
                                             engine i caches H in every group of its
                                             primary class
      P:w:W:B:H                       STRING the same for the class of window W tokens
                                             (0: full attention) and block size B tokens

Tracked classes. A source's groups that hit alike are tracked together as one class: a
block is present in a class while it is cached in every group of it. The primary class
is the full-attention groups (full, MLA, sink) of the first such group's block size; its
bitmaps are ``P:b:H``, the layout from before classes existed, so full-attention-only
sources are written and scored as they always were. Every other class gets bitmaps of
its own, named by what decides its hit rule: a sliding-window class per (window, block
size), and full-attention groups of another block size as window 0. They cannot share
``P:b:H``: a group of block size B indexes a block under the same chained hash as the
full-attention group of the same size (and a coarser group under every k-th one), so one
bitmap would mix what different rules need. A source's meta and registry entry say which
of its groups are in which class (:class:`kvsvc.cluster.store.Tracking`); the scorer
applies each class's rule (:mod:`kvsvc.cluster.score`). Groups of other kinds (Mamba,
chunked local attention, cross attention, ...) are not tracked: such an engine's score
is an upper bound of its Lookup (the tracked classes' hit, aligned to all its groups'
block sizes), and the indexer says once per source which groups it leaves out.

What goes together: a source's keys share one hash tag, so the scripts below, which must
change a source's counts and sequence atomically, touch one slot. Block bitmaps have no
tag: ``P:b:H`` and ``P:w:W:B:H`` of one hash may be on different nodes. Score reads the
bitmaps, one key per prompt block and class, in one MGET (on a cluster, one per slot,
sent to the nodes in one pipelined round), plus the registry (cached, refreshed about
once a second).

On a single Redis (not a cluster) every key is on one server, so the script that
applies a run also sets the block bits it changes, in the same atomic step. On a Redis
Cluster the block keys live on other nodes, so a source's writes happen in two steps.
(1) A script (one slot) applies a run of event batches to the counts, fenced by the
source's lease and guarded by its epoch and sequence (a batch applied twice or out of
order is refused, not applied), and returns the hashes whose bit must change; it
records them in ``pending`` in the same step. (2) The indexer sets those bits
(``SETBIT``, absolute values: repeating it is harmless; a block's last bit goes with a
one-key script that deletes the key, so no all-zero bitmap stays) and the next script
clears ``pending``. An indexer that dies between the two leaves ``pending`` behind, and
whoever takes the lease next writes it first. A ``pending`` entry of the primary class is
H -> "0"/"1" (as before classes existed, so what an older indexer left behind reads the
same); one of another class is the bitmap's whole key -> "k0"/"k1". Only the lease
holder writes a source's bits, so no two indexers ever interleave them; an indexer that
lost its lease (paused past the TTL) is refused by the next script and stops writing.

Bounds: a source's counts hold one field per cached block hash and tracked group (a
pool's cached blocks, at most its block count); the bitmap of a block is (highest engine
id + 1) / 8 bytes, one per class that caches it; engine ids grow by one for each source
name ever indexed (ids are kept across purges so a bitmap bit never changes owner). A
clear, a purge or a snapshot runs over all of one source's fields (one script over a
million fields blocks Redis for about a second).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DEFAULT_PREFIX = "kvsvc"
# Spec kinds whose hits need every block of the prefix (a hit is the longest run of
# consecutive blocks present).
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
# Spec kinds whose hits need only the blocks inside the window before the hit (or a run
# from block 0), given the group's window (IndexGroup.sliding_window).
# Groups of other kinds (Mamba, chunked local attention, cross attention, ...) are not
# tracked, and their engines' scores are upper bounds.
SLIDING_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})


@dataclass(frozen=True, slots=True)
class Keys:
    """The key names of one key prefix."""

    prefix: str = DEFAULT_PREFIX

    def _registry(self, name: str) -> str:
        return f"{self.prefix}:{{{self.prefix}:registry}}:{name}"

    @property
    def ids(self) -> str:
        return self._registry("ids")

    @property
    def next_id(self) -> str:
        return self._registry("next_id")

    @property
    def sources(self) -> str:
        return self._registry("sources")

    @property
    def load(self) -> str:
        """The load vector (:mod:`kvsvc.cluster.load`): in the registry's slot."""
        return self._registry("load")

    def source(self, source: str, name: str) -> str:
        """One of a source's keys (``meta``, ``blocks``, ``pending``, ``lease``, ...)."""
        return f"{self.prefix}:{{{self.prefix}:src:{source}}}:{name}"

    def source_keys(self, source: str, owner: str = "") -> list[str]:
        """The keys every source script gets, in the order the scripts expect; the stage
        keys are ``owner``'s own (an indexer that lost its lease mid-write must not touch
        the snapshot the new holder is staging)."""
        stage = f":{owner}" if owner else ""
        return [
            self.source(source, name)
            for name in (
                "meta",
                "blocks",
                "pending",
                "lease",
                f"stage{stage}",
                f"stage_pending{stage}",
            )
        ]

    def block(self, block_hash: bytes) -> bytes:
        """The primary class's bitmap of a hash (``block(b"")``: the prefix of them all)."""
        return self.prefix.encode() + b":b:" + block_hash

    def class_block(self, window: int, block_size: int, block_hash: bytes) -> bytes:
        """Another class's bitmap of a hash: window ``window`` tokens (0: full attention),
        blocks of ``block_size`` tokens (``block_hash`` b"": the prefix of them all)."""
        return f"{self.prefix}:w:{window}:{block_size}:".encode() + block_hash


# KEYS: meta, blocks, pending, lease, stage, stage_pending.
# ARGV: owner, epoch, first_seq, last_seq, engine id (or -1), nclasses, then per tracked
# class: its bitmap key prefix, its pending form ("h": the primary bitmap, pending field
# = hash, value "0"/"1"; "k": another class, field = the bitmap's key, value "k0"/"k1"),
# its number of groups, its group bytes...; then the ops.
# An op is one string: "S" or "R" + group byte + hash (one block stored / removed), "D" +
# group byte + hash followed by the count change as its own argument (several batches'
# changes to one hash, summed), or "C" (clear).
# Returns {status, "missing:changed", flips...}: status "ok" (flips = pending field,
# pending value, ... for the two-step write; none when the script set the bits), "lease"
# (the caller does not hold the lease), "epoch" (the source's epoch is another), "dup"
# (these batches were applied already), "gap" (a batch before first_seq is missing);
# missing counts removals of hashes that were not there (an inconsistency), changed the
# bits that changed.
APPLY = r"""
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return {'lease'} end
local meta = redis.call('HMGET', KEYS[1], 'epoch', 'seq')
if meta[1] ~= ARGV[2] then return {'epoch'} end
local seq = tonumber(meta[2])
local first, last = tonumber(ARGV[3]), tonumber(ARGV[4])
if seq >= last then return {'dup'} end
if seq ~= first - 1 then return {'gap', tostring(seq)} end
redis.call('DEL', KEYS[3])
-- ARGV[5]: the engine's id when this script sets the block bits itself (a single Redis,
-- not a cluster: the block keys are on this server), -1 for the two-step write.
local engine = tonumber(ARGV[5])
local nclasses = tonumber(ARGV[6])
local prefix, form, members, single, class_of = {}, {}, {}, {}, {}
local i = 6
for c = 1, nclasses do
  prefix[c], form[c] = ARGV[i + 1], ARGV[i + 2]
  local n = tonumber(ARGV[i + 3])
  local groups = {}
  for j = 1, n do
    groups[j] = ARGV[i + 3 + j]
    class_of[groups[j]] = c
  end
  members[c] = groups
  -- One group (the common case): a hash is present while its count is > 0, and
  -- HINCRBY's reply is the count, so each op is one call. Several: counts are read back.
  single[c] = n == 1
  i = i + 3 + n
end
local function present(c, h)
  for _, g in ipairs(members[c]) do
    local v = redis.call('HGET', KEYS[2], g .. h)
    if not v or tonumber(v) <= 0 then return false end
  end
  return true
end
-- Per (class, hash), under the id class byte .. hash: presence before the run, the
-- count now (one-group classes), and the order first seen.
local before, count, order, class, hash = {}, {}, {}, {}, {}
local function first_seen(id, c, h, was)
  before[id] = was
  order[#order + 1] = id
  class[id], hash[id] = c, h
end
local missing = 0
while i < #ARGV do
  i = i + 1
  local op = ARGV[i]
  local kind = string.sub(op, 1, 1)
  if kind == 'C' then
    local fields = redis.call('HGETALL', KEYS[2])
    for j = 1, #fields, 2 do
      local c = class_of[string.sub(fields[j], 1, 1)]
      if c then
        local h = string.sub(fields[j], 2)
        local id = string.char(c) .. h
        if before[id] == nil then
          first_seen(id, c, h, (single[c] and tonumber(fields[j + 1]) > 0)
            or (not single[c] and present(c, h)))
        end
        count[id] = 0
      end
    end
    redis.call('DEL', KEYS[2])
  else
    local field = string.sub(op, 2)
    local c = class_of[string.sub(op, 2, 2)]
    local h = string.sub(op, 3)
    local delta
    if kind == 'S' then
      delta = 1
    elseif kind == 'R' then
      delta = -1
    else
      i = i + 1
      delta = tonumber(ARGV[i])
    end
    local id = c and (string.char(c) .. h)
    if c and before[id] == nil and not single[c] then first_seen(id, c, h, present(c, h)) end
    local n = redis.call('HINCRBY', KEYS[2], field, delta)
    if c and before[id] == nil then first_seen(id, c, h, n - delta > 0) end
    if n <= 0 then
      redis.call('HDEL', KEYS[2], field)
      if n < 0 then missing = missing + 1 end
      n = 0
    end
    if c then count[id] = n end
  end
end
local out = {'ok', tostring(missing)}
local pending = {}
local changed = 0
for _, id in ipairs(order) do
  local c, h = class[id], hash[id]
  local now
  if single[c] then now = count[id] > 0 else now = present(c, h) end
  if now ~= before[id] then
    changed = changed + 1
    local key = prefix[c] .. h
    if engine >= 0 then
      if now then
        redis.call('SETBIT', key, engine, 1)
      else
        redis.call('SETBIT', key, engine, 0)
        if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
      end
    else
      local bit = now and '1' or '0'
      local field, value = h, bit
      if form[c] == 'k' then field, value = key, 'k' .. bit end
      out[#out + 1] = field
      out[#out + 1] = value
      pending[#pending + 1] = field
      pending[#pending + 1] = value
      if #pending >= 1000 then
        redis.call('HSET', KEYS[3], unpack(pending))
        pending = {}
      end
    end
  end
end
if #pending > 0 then redis.call('HSET', KEYS[3], unpack(pending)) end
redis.call('HSET', KEYS[1], 'seq', ARGV[4])
out[2] = tostring(missing) .. ':' .. tostring(changed)
return out
"""

# Installs a staged snapshot: stage -> blocks, stage_pending -> pending (without the TTL
# the stage keys had), and the meta fields given (ARGV: owner, field, value, field,
# value, ...). Returns "ok" or "lease".
INSTALL = r"""
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return 'lease' end
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('RENAME', KEYS[5], KEYS[2])
  redis.call('PERSIST', KEYS[2])
else
  redis.call('DEL', KEYS[2])
end
if redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('RENAME', KEYS[6], KEYS[3])
  redis.call('PERSIST', KEYS[3])
end
if #ARGV > 1 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
else
  redis.call('DEL', KEYS[1])
end
return 'ok'
"""

# Clears ``pending`` once its bits are written (ARGV: owner). Returns "ok" or "lease".
CLEAR_PENDING = r"""
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return 'lease' end
redis.call('DEL', KEYS[3])
return 'ok'
"""

# Takes or keeps the lease (ARGV: owner, ttl ms): "ok" when the caller holds it after.
LEASE = r"""
local holder = redis.call('GET', KEYS[4])
if holder == false then
  redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[2])
  return 'new'
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
  return 'ok'
end
return 'held'
"""

# Extends the lease its caller holds (ARGV: owner, ttl ms): "ok", or "lost" when the lease
# is gone or another's. Never takes a lease: one that lapsed is taken again by its writer
# (LEASE), at a point where it re-reads what the index holds.
RENEW = r"""
if redis.call('GET', KEYS[4]) ~= ARGV[1] then return 'lost' end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
return 'ok'
"""

# Clears engine ARGV[1]'s bit of one block and deletes the block's key once no bit is
# left (an all-zero bitmap would stay forever otherwise). One key: any slot.
CLEAR_BIT = r"""
redis.call('SETBIT', KEYS[1], ARGV[1], 0)
if redis.call('BITCOUNT', KEYS[1]) == 0 then redis.call('DEL', KEYS[1]) end
return 0
"""

# Gives the lease back (ARGV: owner).
RELEASE = r"""
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
return 'ok'
"""


def script_sha(script: str) -> str:
    """The SHA-1 Redis names a script by (EVALSHA)."""
    return hashlib.sha1(script.encode()).hexdigest()
