--! uses: stored chain
-- Delete a response or a conversation. KEYS: its hash, then its list, and a response's
-- chain (chain.lua: its turn goes once no later turn needs it). ARGV: owner, op id, its id.
-- Returns {'status', 'ok', 'session', id} (the session that held its state) or {'status', 'missing'}.
-- The hash stays a minute as a tombstone that no tenant owns ('-'), so that the retry of
-- this delete knows its first run, and it answers as that run did.
if redis.call('HGET', KEYS[1], 'owner') == '-' and done(KEYS[1], ARGV[2]) then
  return {'status', 'ok', 'session', redis.call('HGET', KEYS[1], 'session') or ''}
end
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
local session = redis.call('HGET', KEYS[1], 'session') or ''
redis.call('DEL', KEYS[1], KEYS[2])
if KEYS[3] then chain_release(KEYS[3], ARGV[3]) end
redis.call('HSET', KEYS[1], 'owner', '-', 'op', ARGV[2], 'session', session)
redis.call('EXPIRE', KEYS[1], 60)
return {'status', 'ok', 'session', session}
