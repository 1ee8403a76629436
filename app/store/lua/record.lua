--! uses: now ledger
-- Enter a session's stored bytes and expiry in its tenant's ledger. KEYS: live, bytes, made.
-- ARGV: session id, its bytes, its expiry (unix s), '1' to check the limits first, most
-- sessions, most bytes, its kind ('s', or 'e': ephemeral), and a place held for it (`hold`;
-- '' for none). A session new to the ledger takes that place, if it is still held, in the
-- same step: the place was counted when it was held. Returns {'status',
-- 'ok'|'sessions'|'bytes', 'sessions', count, 'state_bytes', total, 'placed', '1'|'0'}.
local placed = '0'
local place = ARGV[8] or ''
local held = place ~= '' and redis.call('ZSCORE', KEYS[1], place)
if held and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZREM', KEYS[1], place)
  redis.call('HDEL', KEYS[2], place)  -- (a place holds no bytes)
  placed = '1'
end
local status, count, total = record(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), ARGV[3],
                                    ARGV[4] == '1', tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7])
if status ~= 'ok' and placed == '1' then
  -- refused (its bytes): the place stays held for the request
  redis.call('ZADD', KEYS[1], held, place)
  redis.call('HSET', KEYS[2], place, 0)
  placed = '0'
end
return {'status', status, 'sessions', count, 'state_bytes', total, 'placed', placed}
