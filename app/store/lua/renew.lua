-- Renew a writer lock's lease, only for its holder. KEYS: lock. ARGV: token, lease ms.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
