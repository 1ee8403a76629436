-- What the scripts of responses and conversations share (app/store/responses.py). A stored
-- object is a hash whose `owner` field is its tenant; another owner's object is missing.
local function mine(key, owner)
  return redis.call('EXISTS', key) == 1 and (redis.call('HGET', key, 'owner') or '') == owner
end

-- a retry of write `op` (a random id, never reused) that already ran: each write of a
-- stored object keeps its op id in the hash ('op'), so the client's retry of a write whose
-- answer was lost answers as the first run did
local function done(key, op)
  return op ~= '' and redis.call('HGET', key, 'op') == op
end

-- a response still running in the background (a worker may write it)
local function active(key)
  local s = redis.call('HGET', key, 'status')
  return s == 'queued' or s == 'in_progress'
end

-- end an active response as `status`: its body says so (with `err`, an OpenAI error object,
-- when failed), and the event that ends a stream goes last in its events
local function finish(keys, status, err)
  local body = cjson.decode(redis.call('HGET', keys[1], 'body'))
  body['status'] = status
  if err then body['error'] = err end
  local encoded = cjson.encode(body)
  redis.call('HSET', keys[1], 'status', status, 'body', encoded)
  if status == 'failed' then
    local seq = redis.call('LLEN', keys[2])
    redis.call('RPUSH', keys[2], cjson.encode({type = 'response.failed', sequence_number = seq, response = body}))
  end
  return encoded
end
