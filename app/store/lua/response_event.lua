--! uses: stored
-- A background worker appends an event of its response and renews its lease. KEYS:
-- response, events (a stream). ARGV: owner, event JSON ('' for none: a heartbeat), lease
-- end (unix s), ttl seconds, op id, the event's type. Returns {'status', 'ok'} or
-- {'status', 'stopped'} (cancelled, failed or deleted: the worker stops, and nothing of it
-- is written).
if mine(KEYS[1], ARGV[1]) and done(KEYS[1], ARGV[5]) then return {'status', 'ok'} end
if not mine(KEYS[1], ARGV[1]) or not active(KEYS[1]) then return {'status', 'stopped'} end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'op', ARGV[5])
  add_event(KEYS, ARGV[6], ARGV[2])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
end
redis.call('HSET', KEYS[1], 'lease', ARGV[3])
return {'status', 'ok'}
