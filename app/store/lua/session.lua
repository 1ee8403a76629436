-- What every session script shares. A session's keys, as every session script takes them
-- (one hash slot, {ID}): KEYS[1] session (hash), KEYS[2] deltas (list), KEYS[3] lock,
-- KEYS[4] history (hash), KEYS[5] transcript (list).

local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0')
end

-- re-arm the session's sliding TTL; returns the new expiry
local function touch(keys)
  local ttl = tonumber(redis.call('HGET', keys[1], 'ttl'))
  local exp = string.format('%.6f', now() + ttl)
  redis.call('HSET', keys[1], 'expires_at', exp)
  for _, i in ipairs({1, 2, 4, 5}) do redis.call('EXPIRE', keys[i], ttl) end
  return exp
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
                       'expires_at', 'ttl', 'delta_bytes', 'commit', 'keep', 'tokens')
  return {
    'version', h[1], 'n_tokens', h[2], 'model', h[3], 'fingerprint', h[4],
    'created_at', h[5], 'expires_at', h[6], 'ttl', h[7],
    'snapshot_bytes', tostring(redis.call('HSTRLEN', key, 'state')),
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
    table.insert(out, redis.call('HGET', keys[1], 'state'))
    table.insert(out, 'deltas')
    table.insert(out, redis.call('LRANGE', keys[2], 0, -1))
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
