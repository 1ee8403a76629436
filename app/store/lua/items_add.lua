--! uses: stored
-- Append items (JSON each) to a conversation. KEYS: conversation, items. ARGV: owner,
-- ttl seconds, op id, items... Returns {'status', 'ok', 'count', n} or {'status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if done(KEYS[1], ARGV[3]) then return {'status', 'ok', 'count', redis.call('LLEN', KEYS[2])} end
local n = redis.call('LLEN', KEYS[2])
if #ARGV > 3 then n = redis.call('RPUSH', KEYS[2], unpack(ARGV, 4)) end
redis.call('HSET', KEYS[1], 'op', ARGV[3])
for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, tonumber(ARGV[2])) end
return {'status', 'ok', 'count', n}
