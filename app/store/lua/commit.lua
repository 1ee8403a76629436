--! uses: now session
-- Commit version expected + 1, only if the session is still at the expected version (the
-- fence). KEYS: the session's six. ARGV: expected version, n_tokens, lock token, 'delta' |
-- 'snapshot', blob, new commit id, transcript segment (or ''), transcript bound, the new
-- tokens' hash, and optionally a new ttl (seconds; '': unchanged) and a holder's id ('':
-- none): the session is then kept that long, and held by that holder (`hold`, session.lua:
-- a response whose state it is) until the holder lets go (delete.lua). A delta is appended; a snapshot replaces state and deltas, which move to
-- the history (when more than one version is kept). Returns {'status', 'ok', 'meta', meta},
-- {'status', 'missing'} or {'status', 'conflict', 'version', v}. A retry that finds its own
-- commit id current (its first run's answer was lost) answers as that run did. The new
-- snapshot or delta is a page named by the commit id (session.lua).
if redis.call('EXISTS', KEYS[1]) == 0 then return {'status', 'missing'} end
upgrade(KEYS)
if redis.call('HGET', KEYS[1], 'commit') == ARGV[6] then return {'status', 'ok', 'meta', meta(KEYS[1])} end
local v = redis.call('HGET', KEYS[1], 'version')
if v ~= ARGV[1] then return {'status', 'conflict', 'version', v} end
local new = tonumber(v) + 1
if ARGV[4] == 'delta' then  -- (a new page first: the write a full Redis refuses, see create.lua)
  put_page(KEYS, ARGV[6], ARGV[5])
  redis.call('RPUSH', KEYS[2], ARGV[6])
  redis.call('HINCRBY', KEYS[1], 'delta_bytes', string.len(ARGV[5]))
else
  local base, old = base_of(KEYS), redis.call('HGET', KEYS[1], 'state')
  local chain = redis.call('LRANGE', KEYS[2], 0, -1)
  local size = num(KEYS[1], 'snapshot_bytes') + num(KEYS[1], 'delta_bytes')
  put_page(KEYS, ARGV[6], ARGV[5])
  redis.call('HSET', KEYS[1], 'state', ARGV[6], 'snapshot_bytes', string.len(ARGV[5]), 'delta_bytes', 0)
  redis.call('DEL', KEYS[2])
  if num(KEYS[1], 'keep') > 1 then  -- the replaced chain's pages, for the kept versions built on it
    redis.call('HSET', KEYS[4], 's:' .. base, old)
    for i, d in ipairs(chain) do redis.call('HSET', KEYS[4], 'd:' .. (base + i), d) end
    redis.call('HINCRBY', KEYS[1], 'history_bytes', size)
  else
    drop_page(KEYS, old)
    for _, d in ipairs(chain) do drop_page(KEYS, d) end
    redis.call('HSET', KEYS[1], 'blob_lo', new)
  end
end
redis.call('HSET', KEYS[1], 'version', new, 'n_tokens', ARGV[2], 'commit', ARGV[6])
remember(KEYS, new, ARGV[2], base_of(KEYS), ARGV[9])
prune(KEYS, new)
transcribe(KEYS, ARGV[7], tonumber(ARGV[8]))
if (ARGV[10] or '') ~= '' then redis.call('HSET', KEYS[1], 'ttl', ARGV[10]) end
hold(KEYS, ARGV[11] or '')
touch(KEYS)
if redis.call('GET', KEYS[3]) == ARGV[3] then redis.call('DEL', KEYS[3]) end
return {'status', 'ok', 'meta', meta(KEYS[1])}
