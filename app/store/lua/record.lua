--! uses: now ledger
-- Enter a session's stored bytes and expiry in its tenant's ledger. KEYS: live, bytes, made.
-- ARGV: session id, its bytes, its expiry (unix s), '1' to check the limits first, most
-- sessions, most bytes, its kind ('s', or 'e': ephemeral). Returns {'status',
-- 'ok'|'sessions'|'bytes', 'sessions', count, 'state_bytes', total}.
local status, count, total = record(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), ARGV[3],
                                    ARGV[4] == '1', tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7])
return {'status', status, 'sessions', count, 'state_bytes', total}
