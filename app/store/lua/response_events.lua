--! uses: stored
-- A background response's events after index ARGV[2], and whether it has ended (read
-- together, so a reader that saw an end has seen every event). KEYS: response, events.
-- ARGV: owner, first index. Returns {'status', 'ok', 'ended', 0|1, 'events', {...}} or
-- {'status', 'missing'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
local ended = active(KEYS[1]) and 0 or 1
return {'status', 'ok', 'ended', ended, 'events', redis.call('LRANGE', KEYS[2], tonumber(ARGV[2]), -1)}
