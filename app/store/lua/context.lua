--! uses: stored
-- A stored response as a continuation reads it: its fields, and, unless its state can be
-- continued by a turn rendered alone (it ends where its reply closes, `closing` is set, under
-- the frame the caller renders under), the conversation it ends, found by walking its
-- chain's turns (chain.lua) from its own to the first. KEYS: its hash, its events, its
-- chain. ARGV: owner, its id, the key of its chain's responses less their ids' rest
-- (`response:{resp_X}`), the chain's tag, the caller's frame ('' : walk), field names.
-- Returns {'.status', 'ok', name, value, ..., '.walked', ''} or, walked, {..., '.walked',
-- '1', '.turns', {JSON, ...}, '.root', R, '.first', F}: the turns oldest first; R '' when
-- the first turn opens the conversation, 'conv_…' when its response followed a
-- conversation's items, else the id of a response stored before chains, whose `context`
-- field is the first entry; F the id of the response whose turn is the first. Or
-- {'.status', 'missing'} (not the owner's), or '.walked' 'broken' (a turn is gone).
if not mine(KEYS[1], ARGV[1]) then return {'.status', 'missing'} end
local out = {'.status', 'ok'}
local values = redis.call('HMGET', KEYS[1], unpack(ARGV, 6))
for i = 6, #ARGV do
  table.insert(out, ARGV[i])
  table.insert(out, values[i - 5] or '')
end
local closing = redis.call('HMGET', KEYS[1], 'closing', 'frame')
if ARGV[5] ~= "" and (closing[1] or "") ~= "" and closing[2] == ARGV[5] then
  table.insert(out, '.walked'); table.insert(out, '')
  return out
end
local turns, id, root, first = {}, ARGV[2], '', ARGV[2]
while id ~= '' do
  local turn = redis.call('HGET', KEYS[3], 's:' .. id)
  if not turn then
    if string.sub(id, 1, 5) == 'conv_' then root = id; break end
    local older = redis.call('HGET', ARGV[3] .. string.sub(id, #ARGV[4] + 1), 'context')
    if not older or older == '' then
      table.insert(out, '.walked'); table.insert(out, 'broken')
      return out
    end
    table.insert(turns, older)
    root, first = id, id
    break
  end
  table.insert(turns, turn)
  first = id
  id = redis.call('HGET', KEYS[3], 'p:' .. id) or ''
end
local ordered = {}
for i = #turns, 1, -1 do table.insert(ordered, turns[i]) end
for _, x in ipairs({'.walked', '1', '.turns', ordered, '.root', root, '.first', first}) do table.insert(out, x) end
return out
