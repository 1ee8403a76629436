--! uses: now ledger
-- Hold places in a tenant's ledger for the new sessions one request will make, all or none,
-- or give back those it did not use. KEYS: live, bytes, made. ARGV: the places' expiry
-- (unix s; '0' gives the places back), the most sessions, then the places' ids. A place
-- counts as a session of no bytes, listed nowhere; `record` with a place's id turns it into
-- the session it was held for. Returns {'status', 'ok'|'sessions', 'sessions', count,
-- 'state_bytes', total}.
local places = {}
for i = 3, #ARGV do places[#places + 1] = ARGV[i] end
if ARGV[1] == '0' then
  for _, place in ipairs(places) do
    redis.call('ZREM', KEYS[1], place)
    redis.call('HDEL', KEYS[2], place)
  end
  local count, total = prune_ledger(KEYS[1], KEYS[2], KEYS[3])
  keep_ledger(KEYS[1], KEYS[2], KEYS[3])
  return {'status', 'ok', 'sessions', count, 'state_bytes', total}
end
local count, total = prune_ledger(KEYS[1], KEYS[2], KEYS[3])
-- (a retry after a lost connection finds its own first run's places)
if #places > 0 and not redis.call('ZSCORE', KEYS[1], places[1]) then
  if count + #places > tonumber(ARGV[2]) then return {'status', 'sessions', 'sessions', count, 'state_bytes', total} end
  for _, place in ipairs(places) do
    redis.call('ZADD', KEYS[1], ARGV[1], place)
    redis.call('HSET', KEYS[2], place, 0)
  end
end
keep_ledger(KEYS[1], KEYS[2], KEYS[3])
return {'status', 'ok', 'sessions', redis.call('ZCARD', KEYS[1]), 'state_bytes', total}
