--! uses: stored
-- A page of a background response's events: at most ARGV[3] from sequence number ARGV[2],
-- and whether it has ended (read together, so a reader that saw an end and a short page has
-- seen every event). KEYS: response, events (a stream; a list, written before the events
-- were a stream, is read as one). ARGV: owner, first number, most events. Returns
-- {'status', 'ok', 'ended', 0|1, 'types', {...}, 'events', {...}} or {'status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
local ended = active(KEYS[1]) and 0 or 1
local first, most = tonumber(ARGV[2]), tonumber(ARGV[3])
local types, events = {}, {}
if legacy(KEYS) then
  events = redis.call('LRANGE', KEYS[2], first, first + most - 1)
  for i, e in ipairs(events) do types[i] = cjson.decode(e)['type'] end
else
  for i, entry in ipairs(redis.call('XRANGE', KEYS[2], '0-' .. (first + 1), '+', 'COUNT', most)) do
    types[i], events[i] = entry[2][2], entry[2][4]  -- (fields t, e)
  end
end
return {'status', 'ok', 'ended', ended, 'types', types, 'events', events}
