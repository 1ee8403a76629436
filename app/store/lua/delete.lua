--! uses: now session
-- Delete a session. KEYS: the session's five. ARGV: expected version or '', owner. A session
-- being written is busy. Returns {'status', 'ok'}, {'status', 'missing'},
-- {'status', 'busy', 'pttl', ms} or {'status', 'mismatch', 'version', v}.
if not owned(KEYS[1], ARGV[2]) then
  return {'status', 'missing'}
end
local v = redis.call('HGET', KEYS[1], 'version')
if redis.call('EXISTS', KEYS[3]) == 1 then return {'status', 'busy', 'pttl', redis.call('PTTL', KEYS[3])} end
if ARGV[1] ~= '' and v ~= ARGV[1] then return {'status', 'mismatch', 'version', v} end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
return {'status', 'ok'}
