--! uses: now session
-- Take a session's writer lock and read its state, in one step. KEYS: the session's six.
-- ARGV: lock token, lease ms, expected version or '', the commit id whose state the caller
-- holds or '', owner. Returns {'status', 'ok', 'meta', meta[, 'snapshot', s, 'deltas', d]},
-- {'status', 'missing'}, {'status', 'busy', 'pttl', ms} or {'status', 'mismatch', 'version', v}.
-- (a retry that finds the lock its own first run took takes it again)
upgrade(KEYS)
local refused = refusal(KEYS, ARGV[5], ARGV[3])
if refused and not (refused[2] == 'busy' and redis.call('GET', KEYS[3]) == ARGV[1]) then return refused end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
touch(KEYS)
return with_state({'status', 'ok', 'meta', meta(KEYS[1])}, KEYS, ARGV[4])
