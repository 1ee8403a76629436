"""SessionStore: sessions in Redis. The only module that knows the key schema and scripts.

Key schema (`P` is `Settings.key_prefix`, `ID` a session id of 32 lowercase hex digits,
128 random bits):

    P session:{ID}   hash, the session itself; Redis TTL = its `ttl` field (sliding)
        version      int, +1 per committed change (0 at creation)
        n_tokens     int, tokens the state has consumed
        model        name of the model the session was created with
        fingerprint  `lm.fingerprint` of that model; a state never runs on another model
        created_at   unix seconds (Redis server clock)
        expires_at   unix seconds; moved forward by every use
        ttl          seconds of idleness after which the session expires
        state        the state snapshot (`State.to_bytes`: safetensors + JSON; never pickled)
        delta_bytes  total size of the deltas below
        commit       random id of the commit that wrote the current state (64 bits, never reused)
        owner        the tenant: a hash of the API key that created it (never the key);
                     absent = '' (no keys). Every script treats another owner's session
                     as missing, so a tenant cannot even learn that it exists
    P deltas:{ID}    list, the state deltas committed since the snapshot, oldest first
                     (`State.delta_bytes`); the state is snapshot + deltas, merged in order
    P lock:{ID}      string, the writer lock: a random token, with a short lease (PX)
    P history:{ID}   hash, the session's past versions (the last `keep` of them stay readable):
        n:V, t:V, b:V   per kept version V: its n_tokens, commit time, and the version of
                        the snapshot it is built on (its base: the current chain's base is
                        `version` minus the number of `deltas`)
        s:V, d:V        the snapshot and the delta that a replaced chain (see `base`)
                        committed as version V, kept while a kept version is built on them
    P transcript:{ID} list, one packed segment per commit, oldest first (`app.transcript`):
                     the tokens each commit consumed, its action mask, behaviour log-probs,
                     sampling parameters and seed; its oldest entries are dropped past the
                     size bound (`transcript_trimmed` then says so)

More fields of the session hash, for the history and the transcript:
        keep             how many versions stay readable (the current one included)
        history_bytes    bytes of the blobs in `history`
        meta_lo, blob_lo the lowest version whose metadata, and whose blobs, `history` may hold
        transcript_bytes, transcript_trimmed

The id is the keys' hash tag (`{ID}`), so all keys of a session share a Redis Cluster
slot and every script touches one slot. No script spans two sessions: `fork` is a read
followed by a create, which is as safe, since the source is only read.

Every operation on a session is one Lua script (registered once), so it is atomic: `begin` takes the
lock and reads the state in one step; `commit` writes the new state only if the version
is still the one `begin` read (the fence), so a writer whose lock lease expired can never
overwrite a newer commit. A commit either appends a delta or replaces the snapshot and
clears the deltas, in the same step as the version bump. Reads accept the commit id of
the state the caller already holds (a hot cache) and then return no state bytes when it is
still the current one. A commit that replaces the snapshot moves the replaced snapshot
and its deltas into `history` when a kept version still needs them; every commit drops
what no kept version needs any more, and appends its transcript segment: so a kept
version, the transcript and the current state never disagree. Commit ids, unlike version numbers, are never issued twice, even
after Redis loses a commit.
Each use of a session re-arms its TTL (sliding expiry).

Where the sessions live is one URL (`Settings.redis_url`, parsed by `parse_redis_url`):

    redis://[user:pass@]host:port/db            one server (also rediss://, unix://: redis-py's
                                                 own URL forms)
    redis+cluster://[user:pass@]host:port[,host:port...]
                                                 a Redis Cluster; the listed nodes are seeds, the
                                                 client discovers the rest (port default 6379)
    redis+sentinel://[user:pass@]host:port[,host:port...]/service[/db]
                                                 the primary that these Sentinels name `service`,
                                                 asked again for each new connection and about once
                                                 a second in use, so a failover needs no restart
                                                 (port default 26379)

Credentials in a Cluster or Sentinel URL are the Redis servers'; Sentinels are asked
without them. Every form gets the same bounded pool, timeouts and client name.

A dead or unreachable Redis (or, in a Cluster, the primary holding a session's slot)
surfaces as `StoreUnavailable` within the socket timeout, never as a hang. This module
knows nothing of HTTP or tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import ResponseError as RedisResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app import metrics
from app.config import Limits, Settings
from app.logs import clip

_ID_RE = re.compile(r"[0-9a-f]{32}")
_META = ("version", "n_tokens", "model", "fingerprint", "created_at", "expires_at", "ttl")


CLIENT_NAME = "recur"  # every connection's CLIENT SETNAME, to find a replica's in CLIENT LIST


class StoreError(Exception):
    """Base of the store's errors."""


class SessionNotFound(StoreError):
    def __init__(self, session_id: str):
        super().__init__(f"session {clip(session_id)!r} does not exist (never created, deleted, or expired)")


class SessionBusy(StoreError):
    def __init__(self, session_id: str, retry_after: float):
        self.retry_after = retry_after  # seconds until the holder's lease runs out, at most
        super().__init__(
            f"session {clip(session_id)!r} is busy with another request; retry when it has finished "
            f"(its lock lapses within {retry_after:.1f} s if its holder died)"
        )


class VersionMismatch(StoreError):
    def __init__(self, session_id: str, expected: int, actual: int):
        self.actual = actual
        super().__init__(f"session {session_id!r} is at version {actual}, not {expected} (If-Match)")


class CommitConflict(StoreError):
    def __init__(self, session_id: str, expected: int, actual: int | None):
        super().__init__(
            f"session {session_id!r} changed while this request ran (expected version {expected}, "
            f"found {'none: it was deleted' if actual is None else actual}); nothing was committed"
        )


class StoreUnavailable(StoreError):
    """Redis cannot be reached or did not answer in time."""


class QuotaExceeded(StoreError):
    """The tenant is at one of its limits (`limit`: sessions, bytes, requests, tokens); nothing
    was written. `retry_after`: seconds until a rate limit would let it through."""

    def __init__(self, limit: str, message: str, retry_after: float):
        self.limit = limit
        self.retry_after = retry_after
        super().__init__(message)


class StorageFull(StoreError):
    """Redis is near its maxmemory: new sessions and growing commits wait until it has room."""


# -- scripts -------------------------------------------------------------------------------
# shared Lua: `now` from the Redis clock (every replica agrees on it)
_LUA_NOW = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# shared Lua: re-arming a session's sliding TTL, and reading its metadata
_LUA_TOUCH = (
    _LUA_NOW
    + """
-- keys: session, deltas, lock, history, transcript (every session script gets all five)
local function touch(keys)
  local ttl = tonumber(redis.call('HGET', keys[1], 'ttl'))
  local exp = string.format('%.6f', now() + ttl)
  redis.call('HSET', keys[1], 'expires_at', exp)
  for _, i in ipairs({1, 2, 4, 5}) do redis.call('EXPIRE', keys[i], ttl) end
  return exp
end
-- the session exists and belongs to `owner` (another tenant's session is as good as missing)
local function owned(key, owner)
  return redis.call('EXISTS', key) == 1 and (redis.call('HGET', key, 'owner') or '') == owner
end
local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0')
end
-- the version whose snapshot `state` holds: the deltas after it are the versions up to now
local function base_of(keys)
  return num(keys[1], 'version') - redis.call('LLEN', keys[2])
end
local function meta(key)
  local m = redis.call('HMGET', key, 'version', 'n_tokens', 'model', 'fingerprint', 'created_at', 'expires_at', 'ttl')
  m[8] = tostring(redis.call('HSTRLEN', key, 'state'))
  m[9] = redis.call('HGET', key, 'delta_bytes') or '0'
  m[10] = redis.call('HGET', key, 'commit') or ''
  m[11] = tostring(num(key, 'history_bytes') + num(key, 'transcript_bytes'))
  m[12] = redis.call('HGET', key, 'keep') or '1'
  m[13] = redis.call('HGET', key, 'tokens') or ''
  return m
end
-- the state bytes, unless the caller already holds the state of commit `held`
local function with_state(m, key, deltas, held)
  if held == '' or m[10] ~= held then
    m[14] = redis.call('HGET', key, 'state')
    m[15] = redis.call('LRANGE', deltas, 0, -1)
  end
  return m
end
-- a version's metadata in the history
local function remember(keys, v, n, base, tokens)
  redis.call('HSET', keys[4], 'n:' .. v, n, 't:' .. v, string.format('%.6f', now()), 'b:' .. v, base, 'h:' .. v, tokens)
  redis.call('HSET', keys[1], 'tokens', tokens)
end
-- the oldest version a session at `current` keeps (its last `keep`)
local function oldest_kept(keys, current)
  return math.max(0, current - math.max(1, num(keys[1], 'keep')) + 1)
end
-- drop from the history what no kept version (the last `keep` up to `current`) needs
local function prune(keys, current)
  local oldest = oldest_kept(keys, current)
  local base = base_of(keys)
  local cutoff = base
  local b = redis.call('HGET', keys[4], 'b:' .. oldest)  -- (absent: nothing older was kept)
  if oldest < base and b then cutoff = tonumber(b) end
  for u = num(keys[1], 'meta_lo'), oldest - 1 do
    redis.call('HDEL', keys[4], 'n:' .. u, 't:' .. u, 'b:' .. u, 'h:' .. u)
  end
  local freed = 0
  for u = num(keys[1], 'blob_lo'), cutoff - 1 do
    freed = freed + redis.call('HSTRLEN', keys[4], 's:' .. u) + redis.call('HSTRLEN', keys[4], 'd:' .. u)
    redis.call('HDEL', keys[4], 's:' .. u, 'd:' .. u)
  end
  redis.call('HSET', keys[1], 'meta_lo', oldest, 'blob_lo', math.max(cutoff, num(keys[1], 'blob_lo')))
  if freed > 0 then redis.call('HINCRBY', keys[1], 'history_bytes', 0 - freed) end
end
-- append a transcript segment, then drop the oldest ones past `limit` bytes (never the newest)
local function transcribe(keys, segment, limit)
  if segment == '' then return end
  redis.call('RPUSH', keys[5], segment)
  local size = redis.call('HINCRBY', keys[1], 'transcript_bytes', string.len(segment))
  while size > limit and redis.call('LLEN', keys[5]) > 1 do
    size = redis.call('HINCRBY', keys[1], 'transcript_bytes', 0 - string.len(redis.call('LPOP', keys[5])))
    redis.call('HSET', keys[1], 'transcript_trimmed', 1)
  end
end
"""
)

# KEYS: session, deltas, lock, history, transcript. ARGV: ttl, model, fingerprint, n_tokens,
# owner, commit id, versions to keep, transcript bound, number of deltas D, the tokens'
# hash (`app.prefixes`; '' if unknown), snapshot, D deltas, transcript segments...
_CREATE = (
    _LUA_TOUCH
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local ts = string.format('%.6f', now())
-- the first write must be one Redis refuses over maxmemory (HSET, not DEL): after a
-- script's first write, Redis lets the rest through, so a full Redis would take it all
redis.call('HSET', KEYS[1], 'version', 0, 'n_tokens', ARGV[4], 'model', ARGV[2], 'fingerprint', ARGV[3],
           'created_at', ts, 'ttl', ARGV[1], 'state', ARGV[11], 'delta_bytes', 0, 'commit', ARGV[6],
           'keep', ARGV[7], 'history_bytes', 0, 'meta_lo', 0, 'blob_lo', 0 - tonumber(ARGV[9]),
           'transcript_bytes', 0)
local size = 0
redis.call('DEL', KEYS[2], KEYS[4], KEYS[5])
local last = 11 + tonumber(ARGV[9])
for i = 12, last do
  redis.call('RPUSH', KEYS[2], ARGV[i])
  size = size + string.len(ARGV[i])
end
if size > 0 then redis.call('HSET', KEYS[1], 'delta_bytes', size) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'owner', ARGV[5]) end
remember(KEYS, 0, ARGV[4], base_of(KEYS), ARGV[10])
for i = last + 1, #ARGV do transcribe(KEYS, ARGV[i], tonumber(ARGV[8])) end
touch(KEYS)
return meta(KEYS[1])
"""
)

# KEYS: session, deltas. ARGV: '1' to include the state, the commit id whose state the caller
# holds or '', owner, '0' to leave the TTL as it is (a listing). Returns meta [+ snapshot,
# deltas] or nil.
_READ = (
    _LUA_TOUCH
    + """
if not owned(KEYS[1], ARGV[3]) then
  return false
end
if ARGV[4] ~= '0' then touch(KEYS) end
local m = meta(KEYS[1])
if ARGV[1] == '1' then with_state(m, KEYS[1], KEYS[2], ARGV[2]) end
return m
"""
)

# KEYS: session, deltas, lock. ARGV: lock token, lease ms, expected version or '',
# the commit id whose state the caller holds or '', owner.
_BEGIN = (
    _LUA_TOUCH
    + """
if not owned(KEYS[1], ARGV[5]) then
  return {'missing'}
end
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('EXISTS', KEYS[3]) == 1 then return {'busy', redis.call('PTTL', KEYS[3])} end
if ARGV[3] ~= '' and v ~= ARGV[3] then return {'mismatch', v} end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
touch(KEYS)
local m = with_state(meta(KEYS[1]), KEYS[1], KEYS[2], ARGV[4])
table.insert(m, 1, 'ok')
return m
"""
)

# KEYS: session, deltas, lock, history, transcript. ARGV: expected version, n_tokens, lock
# token, 'delta' | 'snapshot', blob, new commit id, transcript segment (or ''), transcript
# bound, the new tokens' hash. A delta is appended; a snapshot replaces state and deltas, which move to the
# history (when more than one version is kept).
_COMMIT = (
    _LUA_TOUCH
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local v = redis.call('HGET', KEYS[1], 'version')
if v ~= ARGV[1] then return {'conflict', v} end
local new = tonumber(v) + 1
if ARGV[4] == 'delta' then
  redis.call('RPUSH', KEYS[2], ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'delta_bytes', string.len(ARGV[5]))
else  -- (HSET before DEL: the first write is the one a full Redis refuses, see _CREATE)
  local base, old = base_of(KEYS), redis.call('HGET', KEYS[1], 'state')
  local chain = redis.call('LRANGE', KEYS[2], 0, -1)
  redis.call('HSET', KEYS[1], 'state', ARGV[5], 'delta_bytes', 0)
  redis.call('DEL', KEYS[2])
  if num(KEYS[1], 'keep') > 1 then  -- the replaced chain, for the kept versions built on it
    local size = string.len(old)
    redis.call('HSET', KEYS[4], 's:' .. base, old)
    for i, d in ipairs(chain) do
      redis.call('HSET', KEYS[4], 'd:' .. (base + i), d)
      size = size + string.len(d)
    end
    redis.call('HINCRBY', KEYS[1], 'history_bytes', size)
  else
    redis.call('HSET', KEYS[1], 'blob_lo', new)
  end
end
redis.call('HSET', KEYS[1], 'version', new, 'n_tokens', ARGV[2], 'commit', ARGV[6])
remember(KEYS, new, ARGV[2], base_of(KEYS), ARGV[9])
prune(KEYS, new)
transcribe(KEYS, ARGV[7], tonumber(ARGV[8]))
touch(KEYS)
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
local m = meta(KEYS[1])
table.insert(m, 1, 'ok')
return m
"""
)

# KEYS: lock. ARGV: token, lease ms. Renews the lease only for the holder.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: lock. ARGV: token. Releases only the holder's lock.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: session, deltas, lock. ARGV: expected version or '', owner. A session being written is busy.
_DELETE = (
    _LUA_TOUCH
    + """
if not owned(KEYS[1], ARGV[2]) then
  return {'missing'}
end
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('EXISTS', KEYS[3]) == 1 then return {'busy', redis.call('PTTL', KEYS[3])} end
if ARGV[1] ~= '' and v ~= ARGV[1] then return {'mismatch', v} end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
return {'ok'}
"""
)

# KEYS: the session's five. ARGV: owner, version ('' = the current one), '1' for its state,
# '1' for the transcript. Returns {'ok', meta, n_tokens and commit time of the version,
# snapshot, deltas (or false, false), transcript segments, trimmed flag (or false, false),
# the version's tokens hash},
# {'missing'}, or {'gone', the oldest kept version}. Re-arms the TTL, only when it answers 'ok'
# (a refused read is no use of the session).
_READ_AT = (
    _LUA_TOUCH
    + """
if not owned(KEYS[1], ARGV[1]) then
  return {'missing'}
end
local m = meta(KEYS[1])
local current = tonumber(m[1])
local v = current
if ARGV[2] ~= '' then v = tonumber(ARGV[2]) end
local n, t = redis.call('HGET', KEYS[4], 'n:' .. v), redis.call('HGET', KEYS[4], 't:' .. v)
if v == current then n, t = m[2], t or m[5] end  -- (a session older than the history: its creation)
if v > current or v < oldest_kept(KEYS, current) or not n then
  return {'gone', tostring(oldest_kept(KEYS, current))}
end
m[6] = touch(KEYS)  -- (the meta's expires_at, as re-armed)
local out = {'ok', m, n, t, false, false, false, false, redis.call('HGET', KEYS[4], 'h:' .. v) or ''}
if v == current then out[9] = m[13] end
if ARGV[3] == '1' then
  local base = base_of(KEYS)
  if v >= base then
    out[5] = redis.call('HGET', KEYS[1], 'state')
    out[6] = {}
    if v > base then out[6] = redis.call('LRANGE', KEYS[2], 0, v - base - 1) end
  else
    local b = tonumber(redis.call('HGET', KEYS[4], 'b:' .. v))
    out[5] = redis.call('HGET', KEYS[4], 's:' .. b)
    out[6] = {}
    for u = b + 1, v do table.insert(out[6], redis.call('HGET', KEYS[4], 'd:' .. u)) end
  end
end
if ARGV[4] == '1' then
  out[7] = redis.call('LRANGE', KEYS[5], 0, -1)
  out[8] = redis.call('HGET', KEYS[1], 'transcript_trimmed') or '0'
end
return out
"""
)

# KEYS: the session's five. ARGV: owner. Returns {'ok', meta, {version, n_tokens, commit
# time}... of every kept version, oldest first} or {'missing'}. Re-arms the TTL.
_VERSIONS = (
    _LUA_TOUCH
    + """
if not owned(KEYS[1], ARGV[1]) then
  return {'missing'}
end
touch(KEYS)
local m = meta(KEYS[1])
local current = tonumber(m[1])
local out = {'ok', m}
for v = oldest_kept(KEYS, current), current do
  local n = redis.call('HGET', KEYS[4], 'n:' .. v)
  if n then table.insert(out, {tostring(v), n, redis.call('HGET', KEYS[4], 't:' .. v)}) end
end
return out
"""
)


# -- tenant scripts: the prefix index -----------------------------------------------------------
# KEYS: candidate prefix keys, longest prefix first (one tenant's: one slot). Returns {i, the
# entry} of the first that exists, or false.
_FIND_PREFIX = """
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v then return {i, v} end
end
return false
"""


# -- tenant scripts: quotas ---------------------------------------------------------------------
# A tenant's keys share its own hash tag ({T}), not its sessions': each script below touches
# one slot, and runs beside (not inside) the session script it guards.

# KEYS: live, bytes. Drops the sessions whose recorded expiry has passed (Redis expired
# them) from the ledger, and returns {count, total bytes}.
_LUA_LEDGER = (
    _LUA_NOW
    + """
local function prune(live, bytes)
  local gone = redis.call('ZRANGEBYSCORE', live, '-inf', now())
  for _, sid in ipairs(gone) do
    local b = tonumber(redis.call('HGET', bytes, sid) or '0')
    redis.call('HDEL', bytes, sid)
    redis.call('HINCRBY', bytes, '_total', 0 - b)  -- (never '-0': Redis refuses it as an integer)
  end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', live, '-inf', now()) end
  return redis.call('ZCARD', live), tonumber(redis.call('HGET', bytes, '_total') or '0')
end
-- the ledger lives as long as its longest-lived session
local function keep(live, bytes)
  local last = redis.call('ZRANGE', live, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', live, bytes)
  else
    local at = math.ceil(tonumber(last[2])) + 60
    redis.call('EXPIREAT', live, at)
    redis.call('EXPIREAT', bytes, at)
  end
end
"""
)

# KEYS: live, bytes. ARGV: session id, its state bytes, its expiry (unix s), '1' to check
# the limits first, most sessions, most bytes. Records the session's bytes and expiry;
# with checking, only if that keeps the tenant within its limits (a shrinking or
# unchanged session always passes). Returns {'ok'|'sessions'|'bytes', count, total}.
_RECORD = (
    _LUA_LEDGER
    + """
local count, total = prune(KEYS[1], KEYS[2])
local old = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local known = redis.call('ZSCORE', KEYS[1], ARGV[1])
local new = tonumber(ARGV[2])
if ARGV[4] == '1' then
  if not known and count >= tonumber(ARGV[5]) then return {'sessions', count, total} end
  if new > old and total - old + new > tonumber(ARGV[6]) then return {'bytes', count, total} end
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], new)
total = redis.call('HINCRBY', KEYS[2], '_total', new - old)
keep(KEYS[1], KEYS[2])
return {'ok', redis.call('ZCARD', KEYS[1]), total}
"""
)

# KEYS: live, bytes. ARGV: session id. A deleted session leaves the ledger.
_FORGET = (
    _LUA_LEDGER
    + """
local b = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[2], '_total', 0 - b)  -- (never '-0': Redis refuses it as an integer)
end
local count, total = prune(KEYS[1], KEYS[2])
keep(KEYS[1], KEYS[2])
return {'ok', count, total}
"""
)

# KEYS: live, bytes. Returns {'ok', count, total}.
_USAGE = (
    _LUA_LEDGER
    + """
local count, total = prune(KEYS[1], KEYS[2])
return {'ok', count, total}
"""
)

# KEYS: rate. ARGV: requests/s, tokens/s (0 = no limit), what to do, a number of tokens. Two
# token buckets holding one second's worth each, refilled from the Redis clock. 'request'
# takes one request token. 'reserve' takes the tokens a request's generations may draw
# (max_tokens x n), only while the token bucket is out of debt: so concurrent requests can
# never overdraw it by more than one request's reservation. 'refund' gives back what a
# generation reserved and did not draw. Returns {'ok'} or {'requests'|'tokens', seconds
# until it would pass}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local rps, tps, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local at = tonumber(b[3] or now)
local r = math.min(rps, tonumber(b[1] or rps) + (now - at) * rps)
local k = math.min(tps, tonumber(b[2] or tps) + (now - at) * tps)
local verdict = {'ok'}
if ARGV[3] == 'refund' then
  k = math.min(tps, k + n)
elseif ARGV[3] == 'reserve' then
  if k <= 0 then verdict = {'tokens', tostring((1 - k) / tps)} else k = k - n end
elseif rps > 0 and r < 1 then
  verdict = {'requests', tostring((1 - r) / rps)}
else
  r = r - 1
end
redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(k), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], 3600)
return verdict
"""


@dataclass(frozen=True)
class SessionMeta:
    id: str
    version: int
    n_tokens: int
    model: str
    fingerprint: str
    created_at: float
    expires_at: float
    ttl: int
    snapshot_bytes: int  # size of the stored snapshot
    delta_bytes: int  # total size of the deltas stored after it
    commit_id: str  # random id of the commit that wrote the current state (never reused)
    history_bytes: int = 0  # the kept past versions' blobs and the transcript
    keep_versions: int = 1  # how many versions stay readable, the current one included
    tokens_hash: str = ""  # identifies the tokens the state consumed (`app.prefixes`; '' unknown)

    @property
    def state_bytes(self) -> int:
        """The current state's stored bytes: its snapshot and deltas."""
        return self.snapshot_bytes + self.delta_bytes

    @property
    def stored_bytes(self) -> int:
        """Everything the session stores, history and transcript included: what its
        tenant's quota counts."""
        return self.state_bytes + self.history_bytes


@dataclass(frozen=True)
class Version:
    """A kept version of a session: readable, forkable, restorable."""

    version: int
    n_tokens: int
    committed_at: float


@dataclass(frozen=True)
class AtVersion:
    """A session (`meta`, its current version) as it was at a kept version."""

    meta: SessionMeta
    version: Version
    state: StateBlobs | None  # when asked for
    transcript: list[bytes] | None  # the packed segments, oldest first, when asked for
    trimmed: bool = False  # the transcript's oldest segments were dropped (its size bound)
    tokens_hash: str = ""  # the version's (`app.prefixes`; '' unknown)


class VersionGone(StoreError):
    def __init__(self, session_id: str, version: int, oldest: int):
        self.oldest = oldest
        super().__init__(
            f"session {session_id!r} no longer keeps version {version} (or never had it): "
            f"the oldest it keeps is {oldest}"
        )


@dataclass(frozen=True)
class Usage:
    """What a tenant holds in Redis now."""

    sessions: int
    state_bytes: int


@dataclass(frozen=True)
class StateBlobs:
    """A session's stored state: a snapshot and the deltas committed after it, in order."""

    snapshot: bytes
    deltas: tuple[bytes, ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.snapshot) + sum(len(d) for d in self.deltas)


def owner_of(key: str) -> str:
    """The tenant a key stands for, as stored with its sessions: a hash, never the key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenant_of(owner: str) -> str:
    """A tenant's id in key names and metrics: 96 bits of its owner hash (`open` without keys)."""
    return owner.removeprefix("sha256:")[:24] or "open"


def new_session_id() -> str:
    return secrets.token_hex(16)


def new_commit_id() -> str:
    """Names one committed state. Versions can repeat if Redis loses a commit (the next
    commit reuses the number for other content); 64 random bits never do, so a hot cache
    keyed by commit id can never mistake a lost state for the current one."""
    return secrets.token_hex(8)


def _meta(session_id: str, raw: list[Any]) -> SessionMeta:
    s = [x.decode() if isinstance(x, bytes) else x for x in raw[:13]]
    return SessionMeta(
        id=session_id,
        version=int(s[0]),
        n_tokens=int(s[1]),
        model=str(s[2]),
        fingerprint=str(s[3]),
        created_at=float(s[4]),
        expires_at=float(s[5]),
        ttl=int(s[6]),
        snapshot_bytes=int(s[7]),
        delta_bytes=int(s[8]),
        commit_id=str(s[9]),
        history_bytes=int(s[10]),
        keep_versions=int(s[11]),
        tokens_hash=str(s[12]),
    )


def _blobs(raw: list[Any]) -> StateBlobs | None:
    """The state bytes after the meta fields, or None when the caller held the current commit."""
    if len(raw) <= 13 or raw[13] is None:
        return None
    blobs = StateBlobs(bytes(raw[13]), tuple(bytes(d) for d in raw[14]))
    metrics.STATE_BYTES_READ.inc(blobs.nbytes)
    return blobs


def _check_status(res: list[Any], session_id: str, expected_version: int | None) -> None:
    """Raise the error a script's refusal (`missing`, `busy`, `mismatch`) stands for."""
    status = res[0].decode()
    if status == "missing":
        raise SessionNotFound(session_id)
    if status == "busy":  # with the lock's remaining lease, in ms
        raise SessionBusy(session_id, max(0, int(res[1])) / 1000)
    if status == "mismatch":
        raise VersionMismatch(session_id, int(expected_version or 0), int(res[1]))


def _arg(version: int | None) -> str:
    return "" if version is None else str(int(version))


# -- where Redis is ------------------------------------------------------------------------
@dataclass(frozen=True)
class RedisTarget:
    """A parsed `Settings.redis_url` (the forms are in the module docstring)."""

    kind: Literal["server", "cluster", "sentinel"]
    nodes: tuple[tuple[str, int], ...] = ()  # Cluster seeds, or the Sentinels
    service: str = ""  # Sentinel: the monitored primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_redis_url(url: str) -> RedisTarget:
    """Raises ValueError, naming the expected form, for a malformed Cluster or Sentinel URL.
    Any other scheme is one server's URL, left for redis-py to parse."""
    scheme, sep, rest = url.partition("://")
    kind = {"redis+cluster": "cluster", "redis+sentinel": "sentinel"}.get(scheme.lower())
    if not sep or kind is None:
        return RedisTarget("server")
    form = {
        "cluster": "redis+cluster://[user:password@]host:port[,host:port...]",
        "sentinel": "redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]",
    }[kind]
    netloc, _, path = rest.partition("/")
    path = path.partition("?")[0].strip("/")
    creds, _, hosts = netloc.rpartition("@")
    user, _, password = creds.partition(":")
    default_port = 6379 if kind == "cluster" else 26379
    nodes = []
    for node in filter(None, hosts.split(",")):
        host, colon, port = node.rpartition(":")
        if not colon or "]" in port:  # no port ("[::1]" ends in no port)
            host, port = node, ""
        try:
            nodes.append((unquote(host.strip("[]")), int(port) if port else default_port))
        except ValueError:
            raise ValueError(f"bad port in {node!r}: the Redis URL's form is {form}") from None
    if not nodes or not all(h for h, _ in nodes):
        raise ValueError(f"no host in the Redis URL: its form is {form}")
    parts = path.split("/") if path else []
    if kind == "cluster":
        if parts not in ([], ["0"]):  # a Cluster has database 0 only
            raise ValueError(f"a Redis Cluster has database 0 only: the URL's form is {form}")
        service, db = "", 0
    else:
        if not 1 <= len(parts) <= 2 or not parts[0] or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(f"a Sentinel URL names the service (and may give a db): its form is {form}")
        service, db = unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0
    return RedisTarget(
        kind,  # type: ignore[arg-type]
        tuple(nodes),
        service,
        db,
        username=unquote(user) or None,
        password=unquote(password) or None,
    )


class _SentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The Sentinel-managed primary's connections in the same bounded pool as one server's:
    past `max_connections` busy ones, a command waits for a free one. Each new connection
    asks the Sentinels where the primary is, so after a failover it finds the new one."""

    async def release(self, connection: Any) -> None:
        # a connection that was busy when the primary moved still reaches the old one
        # (redis-py drops only the idle ones): drop it too, so its next use asks again
        if self.master_address is not None and (connection.host, connection.port) != self.master_address:
            await connection.disconnect()
        await super().release(connection)


# errors that mean "Redis, or the Cluster node holding the key, cannot serve now". The
# cluster ones: CLUSTERDOWN, a slot no live primary serves, a slot being moved (TRYAGAIN)
_UNREACHABLE = (
    RedisConnectionError,  # also Sentinel's MasterNotFoundError
    RedisTimeoutError,
    OSError,
    ClusterError,
    SlotNotCoveredError,
    TryAgainError,
)


def _unavailable(exc: Exception) -> StoreUnavailable | None:
    """The StoreUnavailable a Redis error stands for, or None when it is some other error."""
    if isinstance(exc, RedisOutOfMemoryError) or (isinstance(exc, RedisResponseError) and "OOM" in str(exc)):
        # maxmemory reached under `noeviction`: the script's first write was refused, so
        # nothing was written; the session stays as it was
        return StoreUnavailable("Redis is full (maxmemory reached): nothing was written")
    # the cluster client's "no node answered" carries the connection error it last saw
    cause = exc.__cause__ if isinstance(exc, RedisClusterException) else None
    if isinstance(exc, _UNREACHABLE) or isinstance(cause, _UNREACHABLE):
        return StoreUnavailable(f"Redis is unavailable: {exc}")
    return None


class SessionStore:
    def __init__(
        self,
        url: str,
        *,
        key_prefix: str,
        lock_lease_seconds: float,
        timeout: float,
        max_connections: int,
        transcript_max_bytes: int,
    ):
        self.prefix = key_prefix
        self.transcript_max_bytes = transcript_max_bytes
        self.lock_lease_ms = max(1, int(lock_lease_seconds * 1000))
        self.timeout = timeout
        target = parse_redis_url(url)
        self._sentinel: Sentinel | None = None
        self._next_ask = 0.0  # Sentinel: when to ask again where the primary is
        self._asking: asyncio.Task[None] | None = None
        # a Cluster only: one permit per command in flight (see `_connection`)
        self._permits: asyncio.Semaphore | None = None
        self.redis = self._connect(url, target, max_connections)
        r = self.redis
        self._create = r.register_script(_CREATE)
        self._read = r.register_script(_READ)
        self._begin = r.register_script(_BEGIN)
        self._commit = r.register_script(_COMMIT)
        self._renew = r.register_script(_RENEW)
        self._release = r.register_script(_RELEASE)
        self._delete = r.register_script(_DELETE)
        self._read_at = r.register_script(_READ_AT)
        self._versions = r.register_script(_VERSIONS)
        self._find_prefix = r.register_script(_FIND_PREFIX)
        self._record = r.register_script(_RECORD)
        self._forget = r.register_script(_FORGET)
        self._usage = r.register_script(_USAGE)
        self._admit = r.register_script(_ADMIT)
        self._memory_checked = 0.0  # when INFO memory was last read (`storage_full`)
        self._memory_full = False

    def _connect(self, url: str, target: RedisTarget, max_connections: int) -> aioredis.Redis | RedisCluster:
        """The client for `target`, with the same timeouts, retry and client name in every form."""
        timeout = self.timeout
        common: dict[str, Any] = dict(
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
            decode_responses=False,
            client_name=CLIENT_NAME,
        )
        if target.kind == "cluster":
            # max_connections is per node here, and past it the client fails instead of
            # waiting, so the permits keep the bound (and the wait) of a blocking pool;
            # require_full_coverage=False: a shard without a primary must not stop the
            # client from serving every other slot
            self._permits = asyncio.Semaphore(max_connections)
            return RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
                require_full_coverage=False,
                max_connections=max_connections,
                username=target.username,
                password=target.password,
                **common,
            )
        if target.kind == "sentinel":
            self._sentinel = Sentinel(
                list(target.nodes),
                sentinel_kwargs=dict(socket_timeout=timeout, socket_connect_timeout=timeout),
            )
            return self._sentinel.master_for(
                target.service,
                connection_pool_class=_SentinelPool,
                max_connections=max_connections,
                timeout=timeout,
                db=target.db,
                username=target.username,
                password=target.password,
                **common,
            )
        # one server, a bounded pool: past `max_connections` busy ones, a command waits for
        # a free connection (up to `timeout`, then StoreUnavailable) instead of opening another
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **common
        )
        return aioredis.Redis.from_pool(pool)

    @classmethod
    def from_settings(cls, settings: Settings) -> SessionStore:
        if not settings.redis_url:
            raise ValueError("the store needs settings.redis_url (recur serve starts an embedded Redis)")
        return cls(
            settings.redis_url,
            key_prefix=settings.key_prefix,
            lock_lease_seconds=settings.lock_lease_seconds,
            timeout=settings.redis_timeout,
            max_connections=settings.redis_max_connections,
            transcript_max_bytes=int(settings.transcript_max_kb * 1024),
        )

    # -- the key schema (one place) ---------------------------------------------------------
    def session_key(self, session_id: str) -> str:
        return f"{self.prefix}session:{{{session_id}}}"

    def deltas_key(self, session_id: str) -> str:
        return f"{self.prefix}deltas:{{{session_id}}}"

    def lock_key(self, session_id: str) -> str:
        return f"{self.prefix}lock:{{{session_id}}}"

    def history_key(self, session_id: str) -> str:
        return f"{self.prefix}history:{{{session_id}}}"

    def transcript_key(self, session_id: str) -> str:
        return f"{self.prefix}transcript:{{{session_id}}}"

    def ledger_keys(self, tenant: str) -> list[str]:
        """A tenant's ledger: its live sessions by expiry (sorted set), and their bytes (hash)."""
        return [f"{self.prefix}tenant:{{{tenant}}}:live", f"{self.prefix}tenant:{{{tenant}}}:bytes"]

    def prefix_key(self, tenant: str, tokens_hash: str) -> str:
        """A committed token sequence of the tenant's (string: "session_id:version"), by hash."""
        return f"{self.prefix}prefix:{{{tenant}}}:{tokens_hash}"

    def rate_key(self, tenant: str) -> str:
        """A tenant's request and token buckets (hash)."""
        return f"{self.prefix}tenant:{{{tenant}}}:rate"

    def _keys(self, session_id: str) -> list[str]:
        """A session's keys, as every session script takes them (one hash slot)."""
        return [
            self.session_key(session_id),
            self.deltas_key(session_id),
            self.lock_key(session_id),
            self.history_key(session_id),
            self.transcript_key(session_id),
        ]

    # -- plumbing ----------------------------------------------------------------------------
    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        self._follow_primary()
        try:
            async with self._connection():
                if self._permits is None:
                    return await script(keys=keys, args=args)
                # a Cluster: a script missing on the key's node is loaded there alone (EVAL
                # caches it); the Script object's SCRIPT LOAD goes to every primary, and so
                # would fail for every slot while any one primary is down
                try:
                    return await self.redis.evalsha(script.sha, len(keys), *keys, *args)
                except NoScriptError:
                    return await self.redis.eval(script.script, len(keys), *keys, *args)
        except Exception as exc:
            err = _unavailable(exc)
            if self._sentinel is not None and isinstance(exc, RedisResponseError) and "READONLY" in str(exc):
                # a failover demoted the server these connections reach (a script's write
                # fails as a plain error, which redis-py does not take for a failover):
                # drop the idle ones, so the next command asks the Sentinels again
                assert isinstance(self.redis, aioredis.Redis)
                await self.redis.connection_pool.disconnect(inuse_connections=False)
                err = StoreUnavailable(f"Redis is unavailable: the primary became a replica ({exc})")
            if err is None:
                raise
            metrics.REDIS_ERRORS.inc()
            raise err from None

    def _follow_primary(self) -> None:
        """Sentinel: ask the Sentinels where the primary is, at most once a second, off the
        command's path. A failover that leaves the old primary running (SENTINEL FAILOVER,
        a partition) demotes it only when Sentinel reconfigures it, seconds later; until
        then, open connections would go on writing there, and the writes would be lost.
        When the answer changes, the pool drops its connections to the old primary."""
        now = time.monotonic()
        if self._sentinel is None or now < self._next_ask:
            return
        self._next_ask = now + 1.0
        if self._asking is None or self._asking.done():
            self._asking = asyncio.create_task(self._ask_sentinels())

    async def _ask_sentinels(self) -> None:
        assert isinstance(self.redis, aioredis.Redis)
        pool = self.redis.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        with contextlib.suppress(RedisError, OSError):  # the commands themselves will tell
            await pool.get_master_address()

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[None]:
        """A Cluster's stand-in for the blocking pool: a command waits (up to the timeout)
        for one of `max_connections` permits, so no node is ever asked for more."""
        if self._permits is None:
            yield
            return
        try:
            await asyncio.wait_for(self._permits.acquire(), self.timeout)
        except TimeoutError:
            raise RedisConnectionError("No connection available.") from None  # as the pool says
        try:
            yield
        finally:
            self._permits.release()

    @staticmethod
    def _check_id(session_id: str) -> None:
        if not _ID_RE.fullmatch(session_id):
            raise SessionNotFound(session_id)

    async def ping(self) -> None:
        """Redis answers. For a Cluster: some primary answers. One dead primary makes only
        its slots' sessions fail (with StoreUnavailable); it must not make the replica
        unready for every other session, as PING to every primary would."""
        try:
            if isinstance(self.redis, RedisCluster):
                await self._ping_cluster(self.redis)
            else:
                await self.redis.ping()
        except Exception as exc:
            err = _unavailable(exc)
            if err is None:
                raise
            raise err from None

    async def _ping_cluster(self, cluster: RedisCluster) -> None:
        async def one(node: ClusterNode) -> None:
            async with self._connection():
                await cluster.execute_command("PING", target_nodes=node)

        async with self._connection():  # (once: it learns the nodes and their slots)
            await cluster.initialize()
        answers = await asyncio.gather(*map(one, cluster.get_primaries()), return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if len(errors) == len(answers):
            raise errors[0] if errors else RedisConnectionError("the Cluster has no primary")

    async def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
        await self.redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    # -- sessions ----------------------------------------------------------------------------
    async def create(
        self,
        state: StateBlobs,
        n_tokens: int,
        model: str,
        fingerprint: str,
        ttl: int,
        owner: str = "",
        session_id: str | None = None,
        keep: int = 1,
        transcript: list[bytes] | tuple[bytes, ...] = (),
        tokens_hash: str = "",
    ) -> SessionMeta:
        """A new session (under `session_id`, when the caller has reserved one), keeping its
        last `keep` versions, its transcript starting with the `transcript` segments."""
        while True:  # 128 random bits never collide in practice; the script refuses if they do
            sid = session_id or new_session_id()
            raw = await self._run(
                self._create,
                self._keys(sid),
                [
                    int(ttl),
                    model,
                    fingerprint,
                    int(n_tokens),
                    owner,
                    new_commit_id(),
                    int(keep),
                    self.transcript_max_bytes,
                    len(state.deltas),
                    tokens_hash,
                    state.snapshot,
                    *state.deltas,
                    *transcript,
                ],
            )
            if raw:
                metrics.STATE_BYTES_WRITTEN.inc(state.nbytes)
                return _meta(sid, raw)
            if session_id is not None:
                raise StoreError(f"session id {session_id} is taken")

    async def read(
        self, session_id: str, with_state: bool = False, held_commit: str | None = None, owner: str = ""
    ) -> tuple[SessionMeta, StateBlobs | None]:
        """Metadata (and the committed state), re-arming the TTL. No lock needed.

        With `held_commit` (the commit id of a state the caller already holds), the state
        bytes come back only if the session has moved past it.
        """
        self._check_id(session_id)
        raw = await self._run(
            self._read, self._keys(session_id), ["1" if with_state else "0", held_commit or "", owner, "1"]
        )
        if not raw:
            raise SessionNotFound(session_id)
        return _meta(session_id, raw), _blobs(raw)

    async def read_at(
        self,
        session_id: str,
        version: int | None,
        owner: str,
        *,
        state: bool = False,
        transcript: bool = False,
    ) -> AtVersion:
        """A kept version (None: the current one): its state and the transcript when asked
        for, read in one step (so they agree). VersionGone past the kept history."""
        self._check_id(session_id)
        args = [owner, _arg(version), "1" if state else "0", "1" if transcript else "0"]
        res = await self._run(self._read_at, self._keys(session_id), args)
        _check_status(res, session_id, None)
        if res[0] == b"gone":
            raise VersionGone(session_id, -1 if version is None else version, int(res[1]))
        meta = _meta(session_id, res[1])
        at = Version(meta.version if version is None else version, int(res[2]), float(res[3]))
        blobs = None
        if state:
            blobs = StateBlobs(bytes(res[4]), tuple(bytes(d) for d in res[5]))
            metrics.STATE_BYTES_READ.inc(blobs.nbytes)
        segments = [bytes(x) for x in res[6]] if transcript else None
        return AtVersion(meta, at, blobs, segments, transcript and res[7] == b"1", res[8].decode())

    async def versions(self, session_id: str, owner: str) -> tuple[SessionMeta, list[Version]]:
        """The session and its kept versions, oldest first."""
        self._check_id(session_id)
        res = await self._run(self._versions, self._keys(session_id), [owner])
        _check_status(res, session_id, None)
        return _meta(session_id, res[1]), [Version(int(v), int(n), float(t)) for v, n, t in res[2:]]

    async def list_sessions(self, owner: str, cursor: int, count: int) -> tuple[list[SessionMeta], int]:
        """A page of the tenant's live sessions, from its ledger (never `KEYS`), and the
        cursor of the next page (0: no more). Redis's HSCAN guarantees: a session that lives
        through the whole listing appears at least once (the page size is approximate)."""
        bytes_key = self.ledger_keys(tenant_of(owner))[1]
        try:
            async with self._connection():
                cursor, entries = await self.redis.hscan(bytes_key, cursor=cursor, count=count)
        except Exception as exc:
            raise _unavailable(exc) or exc from None
        names = (k.decode() if isinstance(k, bytes) else str(k) for k in entries)
        ids = sorted(n for n in names if _ID_RE.fullmatch(n))
        peeks = [self._run(self._read, self._keys(sid), ["0", "", owner, "0"]) for sid in ids]
        found = await asyncio.gather(*peeks)
        # (a session that expired or was deleted since its ledger entry was read is left out)
        return [_meta(sid, raw) for sid, raw in zip(ids, found, strict=True) if raw], int(cursor)

    async def delete(self, session_id: str, expected_version: int | None = None, owner: str = "") -> None:
        self._check_id(session_id)
        res = await self._run(self._delete, self._keys(session_id), [_arg(expected_version), owner])
        _check_status(res, session_id, expected_version)

    async def begin(
        self,
        session_id: str,
        expected_version: int | None = None,
        held_commit: str | None = None,
        owner: str = "",
    ) -> Writer:
        self._check_id(session_id)
        token = secrets.token_hex(16)
        res = await self._run(
            self._begin,
            self._keys(session_id),
            [token, self.lock_lease_ms, _arg(expected_version), held_commit or "", owner],
        )
        _check_status(res, session_id, expected_version)
        return Writer(self, _meta(session_id, res[1:]), _blobs(res[1:]), token)

    # -- tenants: the prefix index -------------------------------------------------------------
    async def index_prefix(
        self, owner: str, tokens_hash: str, session_id: str, version: int, ttl: int
    ) -> None:
        """Index a committed state by the hash of its tokens, for the owner's stateless
        requests to find; the entry lives as long as the session would without more use."""
        key = self.prefix_key(tenant_of(owner), tokens_hash)
        try:
            async with self._connection():
                await self.redis.set(key, f"{session_id}:{version}", ex=ttl)
        except Exception as exc:
            raise _unavailable(exc) or exc from None

    async def find_prefix(self, owner: str, hashes: list[str]) -> tuple[int, str, int] | None:
        """The first of `hashes` (longest prefix first) that the owner has indexed: (its
        position in `hashes`, session id, version), or None."""
        if not hashes:
            return None
        tenant = tenant_of(owner)
        res = await self._run(self._find_prefix, [self.prefix_key(tenant, h) for h in hashes], [])
        if not res:
            return None
        sid, _, version = bytes(res[1]).decode().partition(":")
        return int(res[0]) - 1, sid, int(version)

    # -- tenants: quotas ------------------------------------------------------------------------
    async def record(
        self, owner: str, session_id: str, state_bytes: int, expires_at: float, limits: Limits | None
    ) -> Usage:
        """Enter a session's stored size and expiry in its tenant's ledger. With `limits`,
        only if the tenant stays within them (else QuotaExceeded, and nothing changes)."""
        tenant = tenant_of(owner)
        check = ["1", limits.sessions, limits.state_bytes] if limits else ["0", 0, 0]
        res = await self._run(
            self._record,
            self.ledger_keys(tenant),
            [session_id, int(state_bytes), f"{expires_at:.3f}", *check],
        )
        status, usage = res[0].decode(), Usage(int(res[1]), int(res[2]))
        if status == "sessions" and limits:
            raise QuotaExceeded(
                "sessions", f"this key holds {usage.sessions} sessions, its limit; delete some first", 60
            )
        if status == "bytes" and limits:
            raise QuotaExceeded(
                "bytes",
                f"this key's sessions hold {usage.state_bytes} bytes of state; {state_bytes} more would "
                f"pass its limit of {limits.state_bytes}: delete sessions first",
                60,
            )
        return usage

    async def forget(self, owner: str, session_id: str) -> Usage:
        """A deleted session leaves its tenant's ledger."""
        res = await self._run(self._forget, self.ledger_keys(tenant_of(owner)), [session_id])
        return Usage(int(res[1]), int(res[2]))

    async def usage(self, owner: str) -> Usage:
        res = await self._run(self._usage, self.ledger_keys(tenant_of(owner)), [])
        return Usage(int(res[1]), int(res[2]))

    async def admit(self, owner: str, limits: Limits) -> None:
        """Take one request from the tenant's request bucket, shared by every replica: else
        QuotaExceeded."""
        if limits.requests_per_second:
            await self._bucket(owner, limits, "request", 0)

    async def reserve_tokens(self, owner: str, limits: Limits, tokens: int) -> None:
        """Reserve the tokens a request's generations may draw from the tenant's token
        bucket, only while it is out of debt: else QuotaExceeded, and nothing is taken."""
        if limits.tokens_per_second:
            await self._bucket(owner, limits, "reserve", tokens)

    async def refund_tokens(self, owner: str, limits: Limits, tokens: int) -> None:
        """Give back reserved tokens a generation did not draw."""
        if limits.tokens_per_second and tokens > 0:
            await self._bucket(owner, limits, "refund", tokens)

    async def _bucket(self, owner: str, limits: Limits, op: str, tokens: int) -> None:
        res = await self._run(
            self._admit,
            [self.rate_key(tenant_of(owner))],
            [limits.requests_per_second, limits.tokens_per_second, op, int(tokens)],
        )
        status = res[0].decode()
        if status != "ok":
            what = "requests per second" if status == "requests" else "generated tokens per second"
            limit = limits.requests_per_second if status == "requests" else limits.tokens_per_second
            raise QuotaExceeded(status, f"this key is at its limit of {limit:g} {what}", float(res[1]))

    async def _memory_info(self) -> list[dict]:
        """INFO memory of the server, or of every primary of a Cluster that answers (a dead
        one is skipped: its own sessions fail on their own)."""
        try:
            async with self._connection():
                if not isinstance(self.redis, RedisCluster):
                    return [await self.redis.info("memory")]
                out = []
                for node in self.redis.get_primaries():
                    with contextlib.suppress(Exception):
                        out.append(await self.redis.info("memory", target_nodes=node))
                return out
        except Exception as exc:
            raise _unavailable(exc) or exc from None

    async def storage_full(self, fraction: float) -> bool:
        """Whether Redis's used memory has passed `fraction` of its maxmemory (read at most
        once a second; never, without a maxmemory)."""
        if time.monotonic() - self._memory_checked < 1.0:
            return self._memory_full
        nodes = await self._memory_info()
        self._memory_full = any(
            int(n.get("maxmemory", 0)) > 0 and int(n.get("used_memory", 0)) >= fraction * int(n["maxmemory"])
            for n in nodes
        )
        self._memory_checked = time.monotonic()
        return self._memory_full


async def _keep_alive(store: SessionStore, key: str, token: str) -> None:
    """Renew a writer's lease while its request works; if renewal fails, the fence still holds."""
    period = store.lock_lease_ms / 3000
    while True:
        await asyncio.sleep(period)
        with contextlib.suppress(StoreError):
            await store._run(store._renew, [key], [token, store.lock_lease_ms])


class Writer:
    """One request's hold on a session: the state it started from, and its one commit."""

    def __init__(self, store: SessionStore, meta: SessionMeta, state: StateBlobs | None, token: str):
        self.store = store
        self.meta = meta
        self.state = state
        self._token = token
        self._done = False
        # (a function of the lock alone, not a method: a task whose frame held `self` would
        # make a reference cycle, keeping this writer and the state bytes it holds alive
        # until the cyclic garbage collector happened to run)
        self._renewer = asyncio.create_task(_keep_alive(store, store.lock_key(meta.id), token))

    async def commit(
        self,
        n_tokens: int,
        *,
        snapshot: bytes | None = None,
        delta: bytes | None = None,
        segment: bytes = b"",
        tokens_hash: str = "",
    ) -> SessionMeta:
        """Commit version `meta.version + 1`, only if nobody committed since `begin`.

        Exactly one of `snapshot` (replaces the whole stored state) or `delta` (appended
        after the stored snapshot and deltas) is given; `segment` is appended to the
        transcript in the same step.
        """
        if self._done:
            raise RuntimeError("a writer commits at most once")
        if (snapshot is None) == (delta is None):
            raise ValueError("commit takes exactly one of snapshot= or delta=")
        s = self.store
        sid = self.meta.id
        mode, blob = ("snapshot", snapshot) if snapshot is not None else ("delta", delta)
        assert blob is not None
        res = await s._run(
            s._commit,
            s._keys(sid),
            [
                self.meta.version,
                int(n_tokens),
                self._token,
                mode,
                blob,
                new_commit_id(),
                segment,
                s.transcript_max_bytes,
                tokens_hash,
            ],
        )
        status = res[0].decode()
        if status == "missing":
            raise CommitConflict(sid, self.meta.version, None)
        if status == "conflict":
            raise CommitConflict(sid, self.meta.version, int(res[1]))
        self._done = True
        self._renewer.cancel()
        metrics.STATE_BYTES_WRITTEN.inc(len(blob))
        return _meta(sid, res[1:])

    async def release(self) -> bool:
        """Give up the lock (a no-op after a successful commit, which released it); whether
        this call gave it up (False: committed, or released before)."""
        self._renewer.cancel()
        if self._done:
            return False
        self._done = True
        # shielded: a cancelled request must still free the lock (else it waits out the lease)
        with contextlib.suppress(StoreError):
            await asyncio.shield(
                self.store._run(self.store._release, [self.store.lock_key(self.meta.id)], [self._token])
            )
        return True
