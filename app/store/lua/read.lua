--! uses: now session
-- A session's metadata, and its state when asked for. KEYS: the session's six. ARGV: '1'
-- to include the state, the commit id whose state the caller holds or '', owner, '0' to
-- leave the TTL as it is (a listing), and optionally how many of the transcript's first
-- segments to include (a listing's previews). Returns {'meta', meta[, 'snapshot', s,
-- 'deltas', d][, 'head', segments]}, or false for a missing (or another owner's) session.
if not owned(KEYS[1], ARGV[3]) then
  return false
end
upgrade(KEYS)
if ARGV[4] ~= '0' then touch(KEYS) end
local out = {'meta', meta(KEYS[1])}
if ARGV[1] == '1' then with_state(out, KEYS, ARGV[2]) end
local head = tonumber(ARGV[5] or '0')
if head > 0 then
  table.insert(out, 'head')
  table.insert(out, redis.call('LRANGE', KEYS[5], 0, head - 1))
end
return out
