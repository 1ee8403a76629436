-- What every ledger script shares. A tenant's keys share its own hash tag ({T}), not its
-- sessions': each ledger script touches one slot, and runs beside (never inside) the session
-- script it follows. KEYS[1] live (sorted set: session id -> expiry), KEYS[2] bytes (hash:
-- session id -> stored bytes, and '_total'), KEYS[3] made (sorted set: 's:' or 'e:' (an
-- ephemeral session) .. session id -> when it entered the ledger, in microseconds).

-- a session leaves the listing
local function unlist(made, sid)
  redis.call('ZREM', made, 's:' .. sid, 'e:' .. sid)
end

-- drop the sessions whose recorded expiry has passed (Redis expired them); {count, total}
local function prune_ledger(live, bytes, made)
  local gone = redis.call('ZRANGEBYSCORE', live, '-inf', now())
  for _, sid in ipairs(gone) do
    local b = tonumber(redis.call('HGET', bytes, sid) or '0')
    redis.call('HDEL', bytes, sid)
    redis.call('HINCRBY', bytes, '_total', 0 - b)  -- (never '-0': Redis refuses it as an integer)
    unlist(made, sid)
  end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', live, '-inf', now()) end
  return redis.call('ZCARD', live), tonumber(redis.call('HGET', bytes, '_total') or '0')
end

-- the ledger lives as long as its longest-lived session
local function keep_ledger(live, bytes, made)
  local last = redis.call('ZRANGE', live, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', live, bytes, made)
  else
    local at = math.ceil(tonumber(last[2])) + 60
    redis.call('EXPIREAT', live, at)
    redis.call('EXPIREAT', bytes, at)
    redis.call('EXPIREAT', made, at)
  end
end

-- record a session's bytes and expiry; with `check`, only if that keeps the tenant within
-- `most_sessions` and `most_bytes` (a shrinking or unchanged session always passes). A
-- session the listing does not hold yet enters it, as `kind` ('s', or 'e': ephemeral; ''
-- for what the ledger counts but the session listing does not show: a stored response).
-- Returns the verdict ('ok', 'sessions' or 'bytes'), and the tenant's count and total.
local function record(live, bytes, made, sid, new, expiry, check, most_sessions, most_bytes, kind)
  local count, total = prune_ledger(live, bytes, made)
  local old = tonumber(redis.call('HGET', bytes, sid) or '0')
  local known = redis.call('ZSCORE', live, sid)
  if check then
    if not known and count >= most_sessions then return 'sessions', count, total end
    if new > old and total - old + new > most_bytes then return 'bytes', count, total end
  end
  redis.call('ZADD', live, expiry, sid)
  redis.call('HSET', bytes, sid, new)
  total = redis.call('HINCRBY', bytes, '_total', new - old)
  if kind ~= '' and not redis.call('ZSCORE', made, 's:' .. sid) and not redis.call('ZSCORE', made, 'e:' .. sid) then
    redis.call('ZADD', made, math.floor(now() * 1000000), kind .. ':' .. sid)
  end
  keep_ledger(live, bytes, made)
  return 'ok', redis.call('ZCARD', live), total
end
