--! uses: stored
-- Delete one item of a conversation. KEYS: conversation, items. ARGV: owner, item id, op
-- id. Its state no longer holds its items as they are: the next turn renders them all
-- (`consumed` goes). Returns {'status', 'ok'|'missing'|'no_item'}.
if not mine(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
if done(KEYS[1], ARGV[3]) then return {'status', 'ok'} end
for _, raw in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if cjson.decode(raw)['id'] == ARGV[2] then
    redis.call('LREM', KEYS[2], 1, raw)
    redis.call('HSET', KEYS[1], 'op', ARGV[3])
    redis.call('HDEL', KEYS[1], 'consumed')
    return {'status', 'ok'}
  end
end
return {'status', 'no_item'}
