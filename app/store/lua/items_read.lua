--! uses: stored
-- A conversation's fields and items. KEYS: conversation, items. ARGV: owner, field names.
-- Returns {'.status', 'ok', 'items', {...}, name, value, ...} or {'.status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'.status', 'missing'} end
local out = {'.status', 'ok', 'items', redis.call('LRANGE', KEYS[2], 0, -1)}
local values = #ARGV > 1 and redis.call('HMGET', KEYS[1], unpack(ARGV, 2)) or {}
for i = 2, #ARGV do
  table.insert(out, ARGV[i])
  table.insert(out, values[i - 1] or '')
end
return out
