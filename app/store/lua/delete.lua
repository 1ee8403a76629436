--! uses: now session
-- Delete a session. KEYS: the session's five. ARGV: expected version or '', owner, a token.
-- A session being written is busy. Returns {'status', 'ok'}, {'status', 'missing'},
-- {'status', 'busy', 'pttl', ms} or {'status', 'mismatch', 'version', v}. The deleted
-- session's lock holds the token for a minute: a retry that finds it (its first run's
-- answer was lost) answers as that run did.
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('GET', KEYS[3]) == ARGV[3] then return {'status', 'ok'} end
local refused = refusal(KEYS, ARGV[2], ARGV[1])
if refused then return refused end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
redis.call('SET', KEYS[3], ARGV[3], 'EX', 60)
return {'status', 'ok'}
