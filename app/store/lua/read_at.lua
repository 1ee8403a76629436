--! uses: now session
-- A kept version of a session (its state and the transcript when asked for), read in one
-- step so that they agree. KEYS: the session's six. ARGV: owner, version ('' = the
-- current one), '1' for its state, '1' for the transcript. Returns {'status', 'ok', 'meta',
-- meta, 'n_tokens', n, 'committed_at', t, 'tokens_hash', h, 'state_bytes', b[, 'snapshot',
-- s, 'deltas', d]
-- [, 'transcript', segments, 'trimmed', '0'|'1']}, {'status', 'missing'}, or
-- {'status', 'gone', 'oldest', the oldest kept version}. Re-arms the TTL only when it
-- answers 'ok' (a refused read is no use of the session).
if not owned(KEYS[1], ARGV[1]) then
  return {'status', 'missing'}
end
upgrade(KEYS)
local current = num(KEYS[1], 'version')
local v = current
if ARGV[2] ~= '' then v = tonumber(ARGV[2]) end
local n, t, h = kept(KEYS, v)
if not n then
  return {'status', 'gone', 'oldest', tostring(oldest_kept(KEYS, current))}
end
touch(KEYS)
local out = {'status', 'ok', 'meta', meta(KEYS[1]), 'n_tokens', n, 'committed_at', t, 'tokens_hash', h}
local snapshot, deltas = pages_at(KEYS, v)
local size = page_len(KEYS, snapshot)
for _, id in ipairs(deltas) do size = size + page_len(KEYS, id) end
table.insert(out, 'state_bytes')
table.insert(out, size)
if ARGV[3] == '1' then
  for _, x in ipairs({'snapshot', page_bytes(KEYS, snapshot), 'deltas', pages_bytes(KEYS, deltas)}) do
    table.insert(out, x)
  end
end
if ARGV[4] == '1' then
  local trimmed = redis.call('HGET', KEYS[1], 'transcript_trimmed') or '0'
  for _, x in ipairs({'transcript', redis.call('LRANGE', KEYS[5], 0, -1), 'trimmed', trimmed}) do
    table.insert(out, x)
  end
end
return out
