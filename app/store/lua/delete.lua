--! uses: now session
-- Delete a session. KEYS: the session's five. ARGV: expected version or '', owner. A session
-- being written is busy. Returns {'status', 'ok'}, {'status', 'missing'},
-- {'status', 'busy', 'pttl', ms} or {'status', 'mismatch', 'version', v}.
local refused = refusal(KEYS, ARGV[2], ARGV[1])
if refused then return refused end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
return {'status', 'ok'}
