--! uses: now session
-- A kept version of a session (its state and the transcript when asked for), read in one
-- step so that they agree. KEYS: the session's five. ARGV: owner, version ('' = the
-- current one), '1' for its state, '1' for the transcript. Returns {'status', 'ok', 'meta',
-- meta, 'n_tokens', n, 'committed_at', t, 'tokens_hash', h[, 'snapshot', s, 'deltas', d]
-- [, 'transcript', segments, 'trimmed', '0'|'1']}, {'status', 'missing'}, or
-- {'status', 'gone', 'oldest', the oldest kept version}. Re-arms the TTL only when it
-- answers 'ok' (a refused read is no use of the session).
if not owned(KEYS[1], ARGV[1]) then
  return {'status', 'missing'}
end
local current = num(KEYS[1], 'version')
local v = current
if ARGV[2] ~= '' then v = tonumber(ARGV[2]) end
local n, t = redis.call('HGET', KEYS[4], 'n:' .. v), redis.call('HGET', KEYS[4], 't:' .. v)
local h = redis.call('HGET', KEYS[4], 'h:' .. v) or ''
if v == current then  -- (a session older than the history: its creation)
  n, t = redis.call('HGET', KEYS[1], 'n_tokens'), t or redis.call('HGET', KEYS[1], 'created_at')
  h = redis.call('HGET', KEYS[1], 'tokens') or ''
end
if v > current or v < oldest_kept(KEYS, current) or not n then
  return {'status', 'gone', 'oldest', tostring(oldest_kept(KEYS, current))}
end
touch(KEYS)
local out = {'status', 'ok', 'meta', meta(KEYS[1]), 'n_tokens', n, 'committed_at', t, 'tokens_hash', h}
if ARGV[3] == '1' then
  local base = base_of(KEYS)
  local snapshot, deltas = nil, {}
  if v >= base then
    snapshot = redis.call('HGET', KEYS[1], 'state')
    if v > base then deltas = redis.call('LRANGE', KEYS[2], 0, v - base - 1) end
  else
    local b = tonumber(redis.call('HGET', KEYS[4], 'b:' .. v))
    snapshot = redis.call('HGET', KEYS[4], 's:' .. b)
    for u = b + 1, v do table.insert(deltas, redis.call('HGET', KEYS[4], 'd:' .. u)) end
  end
  for _, x in ipairs({'snapshot', snapshot, 'deltas', deltas}) do table.insert(out, x) end
end
if ARGV[4] == '1' then
  local trimmed = redis.call('HGET', KEYS[1], 'transcript_trimmed') or '0'
  for _, x in ipairs({'transcript', redis.call('LRANGE', KEYS[5], 0, -1), 'trimmed', trimmed}) do
    table.insert(out, x)
  end
end
return out
