--! uses: stored
-- Append items (JSON each) to a conversation. KEYS: conversation, items. ARGV: owner,
-- ttl seconds, op id, the count of items the writer expects before its own ('' any), items...
-- Returns {'status', 'ok', 'count', n, 'moved', '1' when the count was not the one expected}
-- or {'status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if done(KEYS[1], ARGV[3]) then return {'status', 'ok', 'count', redis.call('LLEN', KEYS[2]), 'moved', ''} end
local n = redis.call('LLEN', KEYS[2])
local moved = (ARGV[4] ~= '' and tonumber(ARGV[4]) ~= n) and '1' or ''
if #ARGV > 4 then n = redis.call('RPUSH', KEYS[2], unpack(ARGV, 5)) end
redis.call('HSET', KEYS[1], 'op', ARGV[3])
for _, k in ipairs(KEYS) do redis.call('EXPIRE', k, tonumber(ARGV[2])) end
return {'status', 'ok', 'count', n, 'moved', moved}
