-- What every session script shares. A session's keys, as every session script takes them
-- (one hash slot, its family's: {F}): KEYS[1] session (hash), KEYS[2] deltas (list of page
-- ids), KEYS[3] lock, KEYS[4] history (hash), KEYS[5] transcript (list), KEYS[6] the
-- family's pages (hash: page id -> references).

local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0')
end

-- Pages. A stored state is a snapshot and the deltas committed after it, each one page: an
-- immutable string at `KEYS[6]:ID`, written once by the write that made it, and named by its
-- id wherever the session keeps it (`state`, the deltas list, the history's s:V and d:V: the
-- manifest). The family's pages hash counts each page's names: a fork names its source's
-- pages instead of copying them. A page goes when its count does (a replaced chain that no
-- kept version needs, a deleted session); a session that expires lets go by time instead:
-- every use gives its pages at least its own TTL, so no page outlives the last session that
-- names it by more than that session's TTL.
local function page(keys, id)
  return keys[6] .. ':' .. id
end

local function put_page(keys, id, bytes)
  redis.call('SET', page(keys, id), bytes)
  redis.call('HINCRBY', keys[6], id, 1)
end

local function name_page(keys, id)
  redis.call('HINCRBY', keys[6], id, 1)
end

local function drop_page(keys, id)
  if redis.call('HINCRBY', keys[6], id, -1) <= 0 then
    redis.call('HDEL', keys[6], id)
    redis.call('DEL', page(keys, id))
  end
end

local function page_bytes(keys, id)
  return redis.call('GET', page(keys, id))
end

local function page_len(keys, id)
  return redis.call('STRLEN', page(keys, id))
end

-- the bytes of the pages `ids`, in order
local function pages_bytes(keys, ids)
  local out = {}
  for _, id in ipairs(ids) do table.insert(out, page_bytes(keys, id)) end
  return out
end

-- the history's page fields (s:V, d:V), each with what it holds: {field, value} pairs
local function history_pages(keys)
  local out, h = {}, redis.call('HGETALL', keys[4])
  for i = 1, #h, 2 do
    local kind = string.sub(h[i], 1, 2)
    if kind == 's:' or kind == 'd:' then table.insert(out, {h[i], h[i + 1]}) end
  end
  return out
end

-- the ids of every page the session names: its snapshot, its deltas, its history's
local function pages_of(keys)
  local ids = redis.call('LRANGE', keys[2], 0, -1)
  table.insert(ids, redis.call('HGET', keys[1], 'state'))
  for _, f in ipairs(history_pages(keys)) do table.insert(ids, f[2]) end
  return ids
end

-- at least `ttl` seconds more for `key` (never less than it has: another session may name it)
local function arm(key, ttl)
  local left = redis.call('TTL', key)
  if left == -1 or (left >= 0 and left < ttl) then redis.call('EXPIRE', key, ttl) end
end

-- at least `ttl` seconds more for the family's count and every page the session names
local function arm_pages(keys, ttl)
  arm(keys[6], ttl)
  for _, id in ipairs(pages_of(keys)) do arm(page(keys, id), ttl) end
end

-- re-arm the session's sliding TTL, and its pages' (at least as long); returns the new expiry
local function touch(keys)
  local ttl = tonumber(redis.call('HGET', keys[1], 'ttl'))
  local exp = string.format('%.6f', now() + ttl)
  redis.call('HSET', keys[1], 'expires_at', exp)
  for _, i in ipairs({1, 2, 4, 5}) do redis.call('EXPIRE', keys[i], ttl) end
  arm_pages(keys, ttl)
  return exp
end

-- a session stored before pages (its bytes in its own fields) moves them into pages, once,
-- in place: every script that reads or writes a session's state calls this first
local function upgrade(keys)
  if redis.call('EXISTS', keys[1]) == 0 or redis.call('HEXISTS', keys[1], 'paged') == 1 then return end
  local c = (redis.call('HGET', keys[1], 'commit') or 'old') .. '.'
  local snapshot = redis.call('HGET', keys[1], 'state') or ''
  put_page(keys, c .. 's', snapshot)
  redis.call('HSET', keys[1], 'state', c .. 's', 'snapshot_bytes', string.len(snapshot), 'paged', 1)
  local deltas = redis.call('LRANGE', keys[2], 0, -1)
  redis.call('DEL', keys[2])
  for i, d in ipairs(deltas) do
    put_page(keys, c .. 'd' .. i, d)
    redis.call('RPUSH', keys[2], c .. 'd' .. i)
  end
  for _, f in ipairs(history_pages(keys)) do
    put_page(keys, c .. f[1], f[2])
    redis.call('HSET', keys[4], f[1], c .. f[1])
  end
  local ttl = redis.call('TTL', keys[1])
  if ttl > 0 then arm_pages(keys, ttl) end
end

-- `holder` (a response whose state the session holds; '': none) holds the session: it is
-- deleted by its holders only once the last one lets go (delete.lua). By name, so a retry
-- counts it once: the holders are fields r:ID, and `holders` their count
local function hold(keys, holder)
  if holder ~= '' and redis.call('HSETNX', keys[1], 'r:' .. holder, 1) == 1 then
    redis.call('HINCRBY', keys[1], 'holders', 1)
  end
end

-- the session exists and belongs to `owner` (another tenant's session is as good as missing)
local function owned(key, owner)
  return redis.call('EXISTS', key) == 1 and (redis.call('HGET', key, 'owner') or '') == owner
end

-- why a writer may not have the session now, as its script answers: {'status', 'missing'}
-- (absent, or another owner's), {'status', 'busy', 'pttl', ms} (locked) or {'status',
-- 'mismatch', 'version', v} (`expected`, unless '', is not the current version); nil: it may
local function refusal(keys, owner, expected)
  if not owned(keys[1], owner) then return {'status', 'missing'} end
  if redis.call('EXISTS', keys[3]) == 1 then return {'status', 'busy', 'pttl', redis.call('PTTL', keys[3])} end
  local v = redis.call('HGET', keys[1], 'version')
  if expected ~= '' and v ~= expected then return {'status', 'mismatch', 'version', v} end
  return nil
end

-- the version whose snapshot `state` holds: the deltas after it are the versions up to now
local function base_of(keys)
  return num(keys[1], 'version') - redis.call('LLEN', keys[2])
end

-- the session's metadata as field/value pairs, named as SessionMeta's fields
-- (app/store/types.py; tests/app/test_store_contract.py checks the two lists are the same)
local function meta(key)
  local h = redis.call('HMGET', key, 'version', 'n_tokens', 'model', 'fingerprint', 'created_at',
                       'expires_at', 'ttl', 'delta_bytes', 'commit', 'keep', 'tokens', 'snapshot_bytes')
  return {
    'version', h[1], 'n_tokens', h[2], 'model', h[3], 'fingerprint', h[4],
    'created_at', h[5], 'expires_at', h[6], 'ttl', h[7],
    'snapshot_bytes', h[12] or '0',
    'delta_bytes', h[8] or '0',
    'commit_id', h[9] or '',
    'history_bytes', tostring(num(key, 'history_bytes') + num(key, 'transcript_bytes')),
    'keep_versions', h[10] or '1',
    'tokens_hash', h[11] or '',
  }
end

-- `out` with the state's bytes appended, unless the caller already holds the state of commit `held`
local function with_state(out, keys, held)
  if held == '' or (redis.call('HGET', keys[1], 'commit') or '') ~= held then
    table.insert(out, 'snapshot')
    table.insert(out, page_bytes(keys, redis.call('HGET', keys[1], 'state')))
    table.insert(out, 'deltas')
    table.insert(out, pages_bytes(keys, redis.call('LRANGE', keys[2], 0, -1)))
  end
  return out
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
    for _, f in ipairs({'s:' .. u, 'd:' .. u}) do
      local id = redis.call('HGET', keys[4], f)
      if id then
        freed = freed + page_len(keys, id)
        drop_page(keys, id)
      end
    end
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

-- the pages of kept version `v` (at most the current one): its snapshot's id, and its
-- deltas' ids in order
local function pages_at(keys, v)
  local base = base_of(keys)
  local deltas = {}
  if v >= base then
    if v > base then deltas = redis.call('LRANGE', keys[2], 0, v - base - 1) end
    return redis.call('HGET', keys[1], 'state'), deltas
  end
  local b = tonumber(redis.call('HGET', keys[4], 'b:' .. v))
  for u = b + 1, v do table.insert(deltas, redis.call('HGET', keys[4], 'd:' .. u)) end
  return redis.call('HGET', keys[4], 's:' .. b), deltas
end

-- kept version `v`'s token count, commit time and tokens' hash; nil past the kept history
local function kept(keys, v)
  local current = num(keys[1], 'version')
  local n, t = redis.call('HGET', keys[4], 'n:' .. v), redis.call('HGET', keys[4], 't:' .. v)
  local h = redis.call('HGET', keys[4], 'h:' .. v) or ''
  if v == current then  -- (a session older than the history: its creation)
    n, t = redis.call('HGET', keys[1], 'n_tokens'), t or redis.call('HGET', keys[1], 'created_at')
    h = redis.call('HGET', keys[1], 'tokens') or ''
  end
  if v > current or v < oldest_kept(keys, current) or not n then return nil end
  return n, t, h
end

-- a new session (`keys`, the family's pages its KEYS[6]) whose state is the snapshot page
-- `snapshot` and then the `deltas` pages, named here, not copied. ARGV-like fields: ttl,
-- model, fingerprint, n_tokens, owner, commit id, keep, the tokens' hash
local function found(keys, f, snapshot, deltas)
  local ts = string.format('%.6f', now())
  redis.call('HSET', keys[1], 'version', 0, 'n_tokens', f.n_tokens, 'model', f.model, 'fingerprint', f.fingerprint,
             'created_at', ts, 'ttl', f.ttl, 'state', snapshot, 'snapshot_bytes', page_len(keys, snapshot),
             'delta_bytes', 0, 'commit', f.commit, 'keep', f.keep, 'history_bytes', 0, 'meta_lo', 0,
             'blob_lo', 0 - #deltas, 'transcript_bytes', 0, 'paged', 1)
  redis.call('DEL', keys[2], keys[4], keys[5])
  local size = 0
  for _, id in ipairs(deltas) do
    redis.call('RPUSH', keys[2], id)
    size = size + page_len(keys, id)
  end
  if size > 0 then redis.call('HSET', keys[1], 'delta_bytes', size) end
  if f.owner ~= '' then redis.call('HSET', keys[1], 'owner', f.owner) end
  remember(keys, 0, f.n_tokens, base_of(keys), f.tokens)
end
