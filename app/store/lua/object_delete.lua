--! uses: stored
-- Delete a response or a conversation. KEYS: its hash, then its list. ARGV: owner.
-- Returns {'status', 'ok', 'session', id} (the session that held its state) or {'status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
local session = redis.call('HGET', KEYS[1], 'session') or ''
redis.call('DEL', unpack(KEYS))
return {'status', 'ok', 'session', session}
