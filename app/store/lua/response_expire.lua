--! uses: now stored
-- Fail a background response whose worker's lease has lapsed (its replica died), or at once
-- (its worker failed). KEYS: response, events. ARGV: the error message, '1' for at once.
-- Returns {'status', 'failed'|'alive'|'gone'}.
if redis.call('EXISTS', KEYS[1]) == 0 or not active(KEYS[1]) then return {'status', 'gone'} end
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease') or '0')
if ARGV[2] ~= '1' and lease > now() then return {'status', 'alive'} end
finish(KEYS, 'failed', {code = 'server_error', message = ARGV[1]})
return {'status', 'failed'}
