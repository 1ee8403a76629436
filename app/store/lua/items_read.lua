--! uses: stored
-- A conversation's fields and items. KEYS: conversation, items. ARGV: owner, 'all' or the
-- caller's frame (then only the items after those its state consumed, its `consumed`
-- field, where that state ends where a reply closes, `closing`, under that frame; else
-- all), then field names. Returns {'.status', 'ok', 'from', i, 'items', {...}, name,
-- value, ...} (the items from index i) or {'.status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'.status', 'missing'} end
local from = 0
if ARGV[2] ~= 'all' and ARGV[2] ~= '' then
  local c = redis.call('HMGET', KEYS[1], 'consumed', 'closing', 'frame')
  if (c[2] or '') ~= '' and c[3] == ARGV[2] then from = tonumber(c[1] or '') or 0 end
end
local out = {'.status', 'ok', 'from', from, 'items', redis.call('LRANGE', KEYS[2], from, -1)}
local values = #ARGV > 2 and redis.call('HMGET', KEYS[1], unpack(ARGV, 3)) or {}
for i = 3, #ARGV do
  table.insert(out, ARGV[i])
  table.insert(out, values[i - 2] or '')
end
return out
