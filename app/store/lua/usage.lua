--! uses: now ledger
-- What a tenant holds. KEYS: live, bytes. Returns {'status', 'ok', 'sessions', count,
-- 'state_bytes', total}.
local count, total = prune_ledger(KEYS[1], KEYS[2])
return {'status', 'ok', 'sessions', count, 'state_bytes', total}
