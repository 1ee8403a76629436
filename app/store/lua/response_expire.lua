--! uses: now stored
-- Fail a background response whose worker's lease has lapsed (its replica died), or at once
-- (its worker failed). KEYS: response, events. ARGV: the error message, '1' for at once.
-- Returns {'status', 'failed'|'alive'|'gone', 'owner', o, 'orphan', session id or ''}:
-- the session its run made and it does not keep, for the sweep to delete.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'status', 'gone', 'owner', '', 'orphan', ''} end
local owner = redis.call('HGET', KEYS[1], 'owner') or ''
if not active(KEYS[1]) then return {'status', 'gone', 'owner', owner, 'orphan', orphan(KEYS[1])} end
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease') or '0')
if ARGV[2] ~= '1' and lease > now() then return {'status', 'alive', 'owner', owner, 'orphan', ''} end
finish(KEYS, 'failed', {code = 'server_error', message = ARGV[1]})
return {'status', 'failed', 'owner', owner, 'orphan', orphan(KEYS[1])}
