--! uses: stored
-- Cancel a background response. KEYS: response, events. ARGV: owner. Returns {'status',
-- 'ok'|'ended'|'missing'|'foreground', 'body', JSON, 'now', its status, 'error', JSON or ''}:
-- an active one is now cancelled; an ended one stays as it is.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if redis.call('HGET', KEYS[1], 'background') ~= '1' then return {'status', 'foreground'} end
local answer = 'ended'
if active(KEYS[1]) then
  finish(KEYS, 'cancelled', nil)
  answer = 'ok'
end
local f = redis.call('HMGET', KEYS[1], 'body', 'status', 'error')
return {'status', answer, 'body', f[1] or '', 'now', f[2] or '', 'error', f[3] or ''}
