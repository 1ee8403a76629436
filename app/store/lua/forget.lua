--! uses: now ledger
-- A deleted session leaves its tenant's ledger. KEYS: live, bytes, made. ARGV: session id.
-- Returns {'status', 'ok', 'sessions', count, 'state_bytes', total}.
local b = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('HINCRBY', KEYS[2], '_total', 0 - b)  -- (never '-0': Redis refuses it as an integer)
end
unlist(KEYS[3], ARGV[1])
local count, total = prune_ledger(KEYS[1], KEYS[2], KEYS[3])
keep_ledger(KEYS[1], KEYS[2], KEYS[3])
return {'status', 'ok', 'sessions', count, 'state_bytes', total}
