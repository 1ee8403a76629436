--! uses: now stored
-- Fail a background response whose worker's lease has lapsed (its replica died). KEYS:
-- response, events. ARGV: the error message. Returns {'status', 'failed'|'alive'|'gone'}.
if redis.call('EXISTS', KEYS[1]) == 0 or not active(KEYS[1]) then return {'status', 'gone'} end
if tonumber(redis.call('HGET', KEYS[1], 'lease') or '0') > now() then return {'status', 'alive'} end
finish(KEYS, 'failed', {code = 'server_error', message = ARGV[1]})
return {'status', 'failed'}
