-- now(): the Redis server's clock, in seconds (every replica agrees on it)
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
