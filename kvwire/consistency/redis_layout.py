"""Redis key layout and Lua scripts of the Redis registry backend (text only, no I/O).

Every key of a namespace ``ns`` starts with the hash tag ``{ns}``, so one namespace lives in
one Redis Cluster slot and every script may touch all of its keys.

=============================  ========  ====================================================
key                            type      content
=============================  ========  ====================================================
``{ns}:seq``                   string    last version handed out (the next is one above
                                         it, never below the Redis clock in microseconds)
``{ns}:seqrun``                string    the server's tenure when ``seq`` last moved
``{ns}:b:<canonical id>``      hash      ``v`` version, ``c`` "1" if complete else "0",
                                         ``l`` lease id holding it in flight (absent if none),
                                         ``e`` that lease's expiry (Redis TIME, microseconds),
                                         ``r`` the server's tenure when begun/committed
``{ns}:lease:<lease id>``      string    expiry (Redis TIME, microseconds); PX set slightly
                                         past it so Redis reclaims dead leases by itself
``{ns}:events`` (channel)      pub/sub   ``"<version> <canonical id>"`` per commit
                                         or invalidation
=============================  ========  ====================================================

Block hashes never expire: a version must never be handed out twice, and forgetting a block
would let its counter restart. Versions come from the one ``seq`` counter, so even a lost
block hash cannot bring an old version back; and a new version is never below the Redis
server's clock in microseconds, so a Redis that lost ``seq`` itself (restarted without
persistence, crashed between snapshots, failed over to a replica behind it) still hands out
versions above those it issued before (unless it had issued more than one per microsecond
since its epoch, far beyond any real rate). Only ``COMMIT`` and ``INVALIDATE`` give a block
a version; ``publish`` writes nothing (it reads the blocks and ``seq`` in one ``READ`` and
confirms blocks complete at exactly the versions given; it raises on a version that cannot
have been issued: above ``seq`` when ``seq`` moved in this server tenure (``seqrun``), else
above the larger of ``seq`` and the clock, as a lost or restored ``seq`` says nothing of the
versions handed out before). A script that would need a version
past ``2**53 - 1`` (exact in a double) refuses, changing nothing. Lease liveness is decided inside the scripts
against ``redis.call('TIME')``, one clock for every client, so client clock skew is moot.

A block is complete only under the server tenure that committed it: ``BEGIN`` and
``COMMIT`` record the server's tenure, ``"<run_id>/<master_replid>"`` (``run_id`` from
``INFO server``: new at every start, and a replica's differs from its primary's;
``master_replid`` from ``INFO replication``: new at every promotion of a replica, and a
server that syncs from a primary takes the primary's), in the block, and every script and
read compares it with the tenure of the server running it.  A data set restored from an
older snapshot (a crash between snapshots, a failover to a replica behind its primary, a
former primary that synced from the new one and is promoted again without a restart)
brings back blocks as they were before later invalidations; those blocks carry an earlier
tenure, so they read as not complete (stale; ``begin`` starts them again) and their leases
cannot commit.  (Redis also gives a primary a new ``master_replid`` each time it starts
or drops its replication backlog: when a replica attaches while it holds none, and when it
drops it after ``repl-backlog-ttl`` with no replica attached; its blocks then read stale
once, failing closed.  ``repl-backlog-ttl 0`` on primaries leaves only the first attach
after each start.)  The tenure cannot see a rolled-back promotion (a promoted replica made
its old primary's replica again, that primary never having changed role): the writes the
promoted replica acknowledged are lost, and the primary's tenure did not change.
The comparison runs inside the server, in the same atomic script as the read or write, so a
client that reconnected without noticing (a connection pool, a retrying client) cannot
pair one server's answer with another's identity.
"""

from __future__ import annotations

from kvwire.errors import UsageError

# Shared prologue: the server's clock in microseconds (exact in a double until 2255).
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""

# Shared prologue: ``tenure``, the identity of the server running the script as it is now:
# its ``run_id`` (INFO server; new at every start) and its ``master_replid`` (INFO
# replication; new at every promotion, taken from the primary at every sync of a replica,
# new on a primary that starts or drops its replication backlog),
# "<run_id>/<master_replid>" (a few microseconds).  Blocks are complete only under the
# tenure that committed them.  A server without either field refuses every script.
_RUN = """
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
if not run then
  return redis.error_reply('no run_id in INFO server')
end
local replid = string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)')
if not replid then
  return redis.error_reply('no master_replid in INFO replication')
end
local tenure = run .. '/' .. replid
"""

# The versions a script hands out come from counter ``key``: ``n`` of them in a row, the first
# one above the counter but never below the server's clock in microseconds (see the module
# docstring). Needs ``now`` (_NOW) and ``tenure`` (_RUN). (Versions go into text with
# string.format('%.0f'): Lua's own number-to-text keeps 14 digits.) ``first_version(key, n)``
# is the first of them, or nil when the last would be past MAX_VERSION (2**53 - 1, exact in a
# double); it writes nothing. ``assign`` (COMMIT's and INVALIDATE's end) computes the
# versions, PUBLISHes them, and only then writes (the counter set to the last one, with
# ``SET``): a refusal (no versions left, a PUBLISH the Redis user may not run on the channel)
# comes before any write, and the script changes nothing.  Before the first PUBLISH it runs
# a write that changes nothing (``SETRANGE`` of an empty string on the counter: it creates
# no key and modifies none): under ``maxmemory`` with ``noeviction`` Redis refuses a
# script's first memory-using write (OOM), and later ones only once that one was refused, so
# a full Redis refuses the script there, before any watcher heard of versions it never wrote.
_NEXT = """
local MAX_VERSION = 9007199254740991
local function first_version(key, n)
  local seq = tonumber(redis.call('GET', key) or '0')
  local first = math.max(seq + 1, now)
  -- (subtracting: first + n could round past MAX_VERSION in a double)
  if n > MAX_VERSION - first + 1 then
    return nil
  end
  return first
end

-- New versions for blocks KEYS[b..]: each PUBLISHed on ``channel`` as "<version> <canonical
-- id>" (the ids are ARGV[ids..]), then written (committed under ``tenure``, or not
-- complete), the block's lease ended, the counter KEYS[seq] set to the last version and
-- KEYS[seqrun] to ``tenure``.  Returns {0, version...}, or {-3} (nothing changed) when no versions are left.
local function assign(seq, seqrun, b, channel, ids, committed)
  local first = first_version(KEYS[seq], #KEYS - b + 1)
  if not first then
    return {-3}
  end
  local out = {0}
  for i = b, #KEYS do
    out[#out + 1] = first + (i - b)  -- (i - b first: first + i could round past 2**53)
  end
  -- A write that changes nothing, refused (OOM) by a Redis out of memory: before any PUBLISH.
  redis.call('SETRANGE', KEYS[seq], 0, '')
  -- Every PUBLISH before the first write: a user the channel's ACL denies fails here, unchanged.
  for i = b, #KEYS do
    redis.call('PUBLISH', channel, string.format('%.0f ', out[i - b + 2]) .. ARGV[ids + i - b])
  end
  for i = b, #KEYS do
    local v = string.format('%.0f', out[i - b + 2])
    if committed then
      redis.call('HSET', KEYS[i], 'v', v, 'c', '1', 'r', tenure)
    else
      redis.call('HSET', KEYS[i], 'v', v, 'c', '0')
    end
    redis.call('HDEL', KEYS[i], 'l', 'e')
  end
  redis.call('SET', KEYS[seq], string.format('%.0f', out[#out]))
  redis.call('SET', KEYS[seqrun], tenure)
  return out
end
"""

# Frees the blocks a lease still holds and deletes the lease. KEYS[first..] are blocks.
_FREE = """
local function free(first, lease_id)
  for i = first, #KEYS do
    if redis.call('HGET', KEYS[i], 'l') == lease_id then
      redis.call('HDEL', KEYS[i], 'l', 'e')
    end
  end
end
"""

BEGIN = (
    _NOW
    + _RUN
    + """
-- KEYS: lease, block...   ARGV: lease_id, ttl_us, lease_px
-- returns {expiry_us, state1, version1, state2, version2, ...}; state s=started b=busy c=complete
-- A block begun or committed under another tenure (an earlier server tenure restored from
-- a snapshot, another server) is neither busy nor complete: it is started again.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('lease id already in use')
end
local exp = now + tonumber(ARGV[2])
local out = {exp}
local started = 0
for i = 2, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'v', 'c', 'l', 'e', 'r')
  local v = tonumber(h[1]) or 0
  if h[3] and tonumber(h[4]) > now and h[5] == tenure then
    out[#out + 1] = 'b'
  elseif h[2] == '1' and h[5] == tenure then
    out[#out + 1] = 'c'
  else
    redis.call('HSET', KEYS[i], 'v', v, 'c', '0', 'l', ARGV[1], 'e', exp, 'r', tenure)
    started = started + 1
    out[#out + 1] = 's'
  end
  out[#out + 1] = v
end
if started > 0 then
  redis.call('SET', KEYS[1], exp, 'PX', ARGV[3])
end
return out
"""
)

COMMIT = (
    _NOW
    + _RUN
    + _NEXT
    + _FREE
    + """
-- KEYS: lease, seq, seqrun, block...   ARGV: lease_id, channel, canonical id per block
-- returns {0, version...} | {-1} lease not live | {-2, index...} blocks lost (1-based:
--   held by another lease or none, or begun under another tenure)
--   | {-3} no versions left below 2**53 (nothing changed, the lease stays)
local exp = tonumber(redis.call('GET', KEYS[1]) or '0')
if exp <= now then
  free(4, ARGV[1])
  redis.call('DEL', KEYS[1])
  return {-1}
end
local lost = {-2}
for i = 4, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'l', 'r')
  if h[1] ~= ARGV[1] or h[2] ~= tenure then
    lost[#lost + 1] = i - 3
  end
end
if #lost > 1 then
  free(4, ARGV[1])
  redis.call('DEL', KEYS[1])
  return lost
end
local out = assign(2, 3, 4, ARGV[2], 3, true)
if out[1] == 0 then
  redis.call('DEL', KEYS[1])
end
return out
"""
)

RENEW = (
    _NOW
    + _RUN
    + _FREE
    + """
-- KEYS: lease, block...   ARGV: lease_id, ttl_us, lease_px
-- returns the new expiry (microseconds) or -1 if the lease is not live: expired, or begun
-- under another tenure (restored from a snapshot: its blocks are neither busy nor
-- committable here, so it is ended, as COMMIT would end it)
local exp = tonumber(redis.call('GET', KEYS[1]) or '0')
if exp <= now then
  return -1
end
for i = 2, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'l', 'r')
  if h[1] == ARGV[1] and h[2] ~= tenure then
    free(2, ARGV[1])
    redis.call('DEL', KEYS[1])
    return -1
  end
end
local new_exp = now + tonumber(ARGV[2])
redis.call('SET', KEYS[1], new_exp, 'PX', ARGV[3])
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'l') == ARGV[1] then
    redis.call('HSET', KEYS[i], 'e', new_exp)
  end
end
return new_exp
"""
)

RELEASE = (
    _FREE
    + """
-- KEYS: lease, block...   ARGV: lease_id[, dead_px]
-- With dead_px (undoing a begin whose reply was lost) the lease key is left dead (expiry 0)
-- for dead_px ms rather than deleted, so a BEGIN of this lease id still on its way finds
-- the id in use and changes nothing.
free(2, ARGV[1])
if ARGV[2] then
  redis.call('SET', KEYS[1], 0, 'PX', ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 0
"""
)

INVALIDATE = (
    _NOW
    + _RUN
    + _NEXT
    + """
-- KEYS: seq, seqrun, block...   ARGV: channel, canonical id per block
-- returns {0, version...} | {-3} no versions left below 2**53 (nothing changed)
return assign(1, 2, 3, ARGV[1], 2, false)
"""
)


READ = (
    _NOW
    + _RUN
    + """
-- KEYS: seq, seqrun, block...   ARGV: '1' to read the issued bound, else '0'
-- returns {bound or 0, version1, state1, ...}: state 1 complete, 2 complete under another
-- tenure (stale: committed in an earlier server tenure or on another server), 0 not
-- complete.  ``bound``: the highest version that can have been handed out: seq if it moved
-- in this server tenure, else the larger of seq and the clock (seq lost or restored from
-- an earlier tenure: the versions handed out before are below the clock).  Writes nothing.
local out = {0}
if ARGV[1] == '1' then
  out[1] = tonumber(redis.call('GET', KEYS[1]) or '0')
  if redis.call('GET', KEYS[2]) ~= tenure then
    out[1] = math.max(out[1], now)
  end
end
for i = 3, #KEYS do
  local h = redis.call('HMGET', KEYS[i], 'v', 'c', 'r')
  out[#out + 1] = tonumber(h[1]) or 0
  if h[2] ~= '1' then
    out[#out + 1] = 0
  elseif h[3] == tenure then
    out[#out + 1] = 1
  else
    out[#out + 1] = 2
  end
end
return out
"""
)


class KeyLayout:
    """The key names of one namespace."""

    def __init__(self, namespace: object) -> None:
        if not isinstance(namespace, str) or not namespace or "{" in namespace or "}" in namespace:
            raise UsageError("a namespace is a non-empty string without '{' or '}'")
        self.namespace = namespace
        self.prefix = "{" + namespace + "}:"
        self.seq = self.prefix + "seq"
        self.seq_run = self.prefix + "seqrun"
        self.channel = self.prefix + "events"

    def block(self, key: str) -> str:
        """The hash of the block with canonical key ``key``."""
        return self.prefix + "b:" + key

    def lease(self, lease_id: str) -> str:
        """The expiry string of lease ``lease_id``."""
        return self.prefix + "lease:" + lease_id


__all__ = ["BEGIN", "COMMIT", "INVALIDATE", "READ", "RELEASE", "RENEW", "KeyLayout"]
