--! uses: now ledger
-- What a tenant holds. KEYS: live, bytes, made. Returns {'status', 'ok', 'sessions', count,
-- 'state_bytes', total, 'kinds', {'session', n, bytes, 'response', n, bytes, 'conversation', n,
-- bytes}}: every entry counts against the key's session limit, and its bytes against its
-- byte quota; the kinds split them, by the entry's id (a stored response's `resp_…`, a
-- conversation's `conv_…`, else a session's: its own, a fork's, or a place held for one).
local count, total = prune_ledger(KEYS[1], KEYS[2], KEYS[3])
local kinds = {session = {0, 0}, response = {0, 0}, conversation = {0, 0}}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local kind = 'session'
  if string.sub(id, 1, 5) == 'resp_' then kind = 'response' elseif string.sub(id, 1, 5) == 'conv_' then kind = 'conversation' end
  kinds[kind][1] = kinds[kind][1] + 1
  kinds[kind][2] = kinds[kind][2] + tonumber(redis.call('HGET', KEYS[2], id) or '0')
end
local split = {}
for _, kind in ipairs({'session', 'response', 'conversation'}) do
  for _, x in ipairs({kind, kinds[kind][1], kinds[kind][2]}) do table.insert(split, x) end
end
return {'status', 'ok', 'sessions', count, 'state_bytes', total, 'kinds', split}
