--! uses: now session
-- Delete a session. KEYS: the session's six. ARGV: expected version or '', owner, a token,
-- and a holder's id ('': none): then the holder lets go (`hold`), and the session is
-- deleted only if no other holder is left, else {'status', 'held'}. A session being
-- written is busy. Returns {'status', 'ok'}, {'status', 'missing'}, {'status', 'held'},
-- {'status', 'busy', 'pttl', ms} or {'status', 'mismatch', 'version', v}. The deleted
-- session's lock holds the token for a minute: a retry that finds it (its first run's
-- answer was lost) answers as that run did.
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('GET', KEYS[3]) == ARGV[3] then return {'status', 'ok'} end
if (ARGV[4] or '') ~= '' and owned(KEYS[1], ARGV[2]) then
  if redis.call('HDEL', KEYS[1], 'r:' .. ARGV[4]) == 1 then redis.call('HINCRBY', KEYS[1], 'holders', -1) end
  if num(KEYS[1], 'holders') > 0 then return {'status', 'held'} end
end
local refused = refusal(KEYS, ARGV[2], ARGV[1])
if refused then return refused end
upgrade(KEYS)
for _, id in ipairs(pages_of(KEYS)) do drop_page(KEYS, id) end  -- (its own pages go; a fork's stay)
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4], KEYS[5])
redis.call('SET', KEYS[3], ARGV[3], 'EX', 60)
return {'status', 'ok'}
