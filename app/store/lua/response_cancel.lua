--! uses: stored
-- Cancel a background response. KEYS: response, events. ARGV: owner. Returns {'status',
-- 'ok'|'ended'|'missing'|'foreground', 'body', JSON}: an active one is now cancelled; an
-- ended one stays as it is.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if redis.call('HGET', KEYS[1], 'background') ~= '1' then return {'status', 'foreground'} end
if not active(KEYS[1]) then return {'status', 'ended', 'body', redis.call('HGET', KEYS[1], 'body')} end
return {'status', 'ok', 'body', finish(KEYS, 'cancelled', nil)}
