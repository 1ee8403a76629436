--! uses: stored
-- Append items (JSON each) to a conversation. KEYS: conversation, items. ARGV: owner,
-- ttl seconds, items... Returns {'status', 'ok', 'count', n} or {'status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
local n = redis.call('LLEN', KEYS[2])
if #ARGV > 2 then n = redis.call('RPUSH', KEYS[2], unpack(ARGV, 3)) end
for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, tonumber(ARGV[2])) end
return {'status', 'ok', 'count', n}
