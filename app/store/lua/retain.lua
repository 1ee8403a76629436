--! uses: now session
-- Give a session a new sliding TTL: a response's session, made to live as a stateless one
-- while its response runs, lives as long as the response once the response keeps it.
-- KEYS: the session's six. ARGV: owner, ttl seconds, and a holder's id ('': none; `hold`).
-- Returns {'status', 'ok', 'meta', {...}} or {'status', 'missing'}. (Absolute values and a
-- holder by name: its retry changes nothing more.)
if not owned(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
upgrade(KEYS)
redis.call('HSET', KEYS[1], 'ttl', ARGV[2])
hold(KEYS, ARGV[3] or '')
touch(KEYS)
return {'status', 'ok', 'meta', meta(KEYS[1])}
