--! uses: stored
-- Read fields of a response or a conversation. KEYS: its hash. ARGV: owner, field names.
-- Returns {'.status', 'ok', name, value, ...} (a missing field: '') or {'.status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'.status', 'missing'} end
local out = {'.status', 'ok'}
local values = redis.call('HMGET', KEYS[1], unpack(ARGV, 2))
for i = 2, #ARGV do
  table.insert(out, ARGV[i])
  table.insert(out, values[i - 1] or '')
end
return out
