-- A chain's turns (app/store/keys.py, `chain:{R}`): each stored response keeps its own turn
-- (its input and its reply, as the chat template reads them) once, named by its id, with
-- its parent's id, so that a continuation writes and reads only what it adds, and the
-- whole conversation is found, when a turn must be rendered whole, by walking the parents.
-- `n:ID` counts a turn's references: its response while it lives, and each child's turn.

-- the turn of response `id` (JSON `turn`, its parent `parent`): once (a retry's second
-- run finds it); the hash lives at least `ttl` seconds more
local function chain_add(key, id, parent, turn, ttl)
  if redis.call('HEXISTS', key, 's:' .. id) == 0 then
    redis.call('HSET', key, 's:' .. id, turn, 'p:' .. id, parent, 'n:' .. id, 1)
    if parent ~= '' and redis.call('HEXISTS', key, 'n:' .. parent) == 1 then
      redis.call('HINCRBY', key, 'n:' .. parent, 1)
    end
  end
  if redis.call('TTL', key) < ttl then redis.call('EXPIRE', key, ttl) end
end

-- response `id` is deleted: its turn goes once nothing refers to it, and so on up the chain
local function chain_release(key, id)
  while id ~= '' and redis.call('HEXISTS', key, 'n:' .. id) == 1 do
    if redis.call('HINCRBY', key, 'n:' .. id, -1) > 0 then break end
    local parent = redis.call('HGET', key, 'p:' .. id) or ''
    redis.call('HDEL', key, 's:' .. id, 'p:' .. id, 'n:' .. id)
    id = parent
  end
  if redis.call('HLEN', key) == 0 then redis.call('DEL', key) end
end
