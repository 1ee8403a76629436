--! uses: now
-- The background responses in progress, by lease end (a sorted set of their own, one
-- slot). KEYS: the set. ARGV: 'add' id end | 'drop' id | 'due' (those lapsed), and 'count'.
-- Returns {'status', 'ok', 'ids', {...}, 'count', n}.
if ARGV[1] == 'add' then redis.call('ZADD', KEYS[1], tonumber(ARGV[3]), ARGV[2]) end
if ARGV[1] == 'drop' then redis.call('ZREM', KEYS[1], ARGV[2]) end
local due = {}
if ARGV[1] == 'due' then due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now(), 'LIMIT', 0, 100) end
return {'status', 'ok', 'ids', due, 'count', redis.call('ZCARD', KEYS[1])}
