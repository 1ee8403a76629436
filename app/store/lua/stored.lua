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

-- append event `json` (its `type` is `kind`) to a response's stream (keys[2]): its entry id
-- is 0-(sequence_number + 1), so the events after number N are the entries after id 0-(N+1);
-- the response's hash counts the stream's bytes (`events_bytes`, for the key's quota). A
-- list, written before the events were a stream, stays one
local function legacy(keys) return redis.call('TYPE', keys[2]).ok == 'list' end
local function events_count(keys)
  return legacy(keys) and redis.call('LLEN', keys[2]) or redis.call('XLEN', keys[2])
end
local function add_event(keys, kind, json)
  if legacy(keys) then
    redis.call('RPUSH', keys[2], json)
  else
    redis.call('XADD', keys[2], '0-' .. (events_count(keys) + 1), 't', kind, 'e', json)
  end
  redis.call('HINCRBY', keys[1], 'events_bytes', #json)
end

-- end an active response as `status`, with `err` (an OpenAI error object, when failed) in
-- its own field: the body is Python's and Lua never re-encodes it (Python lays `status` and
-- `error` over it as it reads it). The event that ends a stream goes last in its events: a
-- failed one's `response.failed` without its response (a replay adds the stored one), a
-- cancelled one's OpenAI's `error` event, code `cancelled`; the events live as long as the hash
local function finish(keys, status, err)
  redis.call('HSET', keys[1], 'status', status)
  if err then redis.call('HSET', keys[1], 'error', cjson.encode(err)) end
  local seq = events_count(keys)
  if status == 'failed' then
    add_event(keys, 'response.failed', cjson.encode({type = 'response.failed', sequence_number = seq}))
  elseif status == 'cancelled' then
    add_event(keys, 'error', cjson.encode({type = 'error', code = 'cancelled', sequence_number = seq,
                                           message = 'the response was cancelled: it ends here'}))
  end
  local ttl = redis.call('PTTL', keys[1])
  if ttl > 0 then redis.call('PEXPIRE', keys[2], ttl) end
end

-- the session a background response's run made (`run`), unless the response keeps it as
-- its state: '' when there is none to release
local function orphan(key)
  local run = redis.call('HGET', key, 'run') or ''
  local s = redis.call('HGET', key, 'status')
  if (s == 'completed' or s == 'incomplete') and redis.call('HGET', key, 'session') == run then return '' end
  return run
end
