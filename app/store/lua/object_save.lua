--! uses: stored
-- Write fields of a response or a conversation. KEYS: its hash (and its list, expired with
-- it). ARGV: owner, ttl seconds, '1' to write only while it is active (a background
-- worker: a cancel or a failure written by another replica wins), op id, then field/value
-- pairs. Returns {'status', 'ok'|'missing'|'stopped'}.
if redis.call('EXISTS', KEYS[1]) == 1 and not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if done(KEYS[1], ARGV[4]) then return {'status', 'ok'} end
if ARGV[3] == '1' and not active(KEYS[1]) then return {'status', 'stopped'} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'op', ARGV[4], unpack(ARGV, 5))
for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, tonumber(ARGV[2])) end
return {'status', 'ok'}
