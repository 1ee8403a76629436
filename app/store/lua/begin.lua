--! uses: now session
-- Take a session's writer lock and read its state, in one step. KEYS: the session's five.
-- ARGV: lock token, lease ms, expected version or '', the commit id whose state the caller
-- holds or '', owner. Returns {'status', 'ok', 'meta', meta[, 'snapshot', s, 'deltas', d]},
-- {'status', 'missing'}, {'status', 'busy', 'pttl', ms} or {'status', 'mismatch', 'version', v}.
if not owned(KEYS[1], ARGV[5]) then
  return {'status', 'missing'}
end
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('EXISTS', KEYS[3]) == 1 then return {'status', 'busy', 'pttl', redis.call('PTTL', KEYS[3])} end
if ARGV[3] ~= '' and v ~= ARGV[3] then return {'status', 'mismatch', 'version', v} end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
touch(KEYS)
return with_state({'status', 'ok', 'meta', meta(KEYS[1])}, KEYS, ARGV[4])
