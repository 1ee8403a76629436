--! uses: now ledger
-- After a write: the ledger takes the session as the write left it (its bytes and expiry),
-- and the prefix index the committed state, in one step. KEYS: live, bytes, made, and the
-- prefix key of the state's tokens (its tenant's, so one slot), or none. ARGV: session id,
-- its bytes, its expiry (unix s), the index entry ('session_id:version'), the entry's TTL
-- (s); and optionally an object the write was for (a stored response: its id, bytes and
-- expiry, the most sessions and bytes), entered too, only within those limits. Returns
-- {'status', 'ok'|'sessions'|'bytes' (the object's refusal), 'sessions', count,
-- 'state_bytes', total}.
local status, count, total = record(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), ARGV[3], false, 0,
                                    0, 's')
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[4], 'EX', ARGV[5]) end
if ARGV[6] then
  status, count, total = record(KEYS[1], KEYS[2], KEYS[3], ARGV[6], tonumber(ARGV[7]), ARGV[8], true,
                                tonumber(ARGV[9]), tonumber(ARGV[10]), '')
end
return {'status', status, 'sessions', count, 'state_bytes', total}
