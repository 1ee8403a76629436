--! uses: stored chain
-- Write fields of a response or a conversation. KEYS: its hash, its list or stream (expired
-- with it), and a response's chain (chain.lua). ARGV: owner, ttl seconds, '1' to write only
-- while it is active (a background worker: a cancel or a failure written by another replica
-- wins), op id, the object's id, its own turn ('' none: JSON for the chain), its parent,
-- then field/value pairs. Returns {'status', 'ok'|'missing'|'stopped'}.
if redis.call('EXISTS', KEYS[1]) == 1 and not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if done(KEYS[1], ARGV[4]) then return {'status', 'ok'} end
if ARGV[3] == '1' and not active(KEYS[1]) then return {'status', 'stopped'} end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'op', ARGV[4], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'parent', ARGV[7])
  chain_add(KEYS[3], ARGV[5], ARGV[7], ARGV[6], ttl)
end
return {'status', 'ok'}
