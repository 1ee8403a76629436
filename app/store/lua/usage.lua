--! uses: now ledger
-- What a tenant holds. KEYS: live, bytes, made. Returns {'status', 'ok', 'sessions', count,
-- 'state_bytes', total}.
local count, total = prune_ledger(KEYS[1], KEYS[2], KEYS[3])
return {'status', 'ok', 'sessions', count, 'state_bytes', total}
