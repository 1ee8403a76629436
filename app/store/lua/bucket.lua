--! uses: now
-- A tenant's two token buckets, each holding one second's worth, refilled from the Redis
-- clock. KEYS: rate. ARGV: requests/s, tokens/s (0 = no limit), what to do, a number of
-- tokens. 'request' takes one request token. 'reserve' takes the tokens a request's
-- generations may draw (max_tokens x n), only while the token bucket is out of debt: so
-- concurrent requests can never overdraw it by more than one request's reservation.
-- 'refund' gives back what a generation reserved and did not draw. Returns
-- {'status', 'ok'} or {'status', 'requests'|'tokens', 'retry_after', seconds}.
local t = now()
local b = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local rps, tps, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local at = tonumber(b[3] or t)
local r = math.min(rps, tonumber(b[1] or rps) + (t - at) * rps)
local k = math.min(tps, tonumber(b[2] or tps) + (t - at) * tps)
local verdict = {'status', 'ok'}
if ARGV[3] == 'refund' then
  k = math.min(tps, k + n)
elseif ARGV[3] == 'reserve' then
  if k <= 0 then verdict = {'status', 'tokens', 'retry_after', tostring((1 - k) / tps)} else k = k - n end
elseif rps > 0 and r < 1 then
  verdict = {'status', 'requests', 'retry_after', tostring((1 - r) / rps)}
else
  r = r - 1
end
redis.call('HSET', KEYS[1], 'r', tostring(r), 't', tostring(k), 'at', tostring(t))
redis.call('EXPIRE', KEYS[1], 3600)
return verdict
