--! uses: now session
-- A new session. KEYS: the session's five. ARGV: ttl, model, fingerprint, n_tokens, owner,
-- commit id, versions to keep, transcript bound, number of deltas D, the tokens' hash
-- (app/prefixes.py; '' if unknown), snapshot, D deltas, transcript segments...
-- Returns {'meta', meta}, or false when the id is taken: by another session, for a retry
-- that finds its own commit id there (its first run's answer was lost) answers as that run did.
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'commit') == ARGV[6] then return {'meta', meta(KEYS[1])} end
  return false
end
local ts = string.format('%.6f', now())
-- the first write must be one Redis refuses over maxmemory (HSET, not DEL): after a
-- script's first write, Redis lets the rest through, so a full Redis would take it all
redis.call('HSET', KEYS[1], 'version', 0, 'n_tokens', ARGV[4], 'model', ARGV[2], 'fingerprint', ARGV[3],
           'created_at', ts, 'ttl', ARGV[1], 'state', ARGV[11], 'delta_bytes', 0, 'commit', ARGV[6],
           'keep', ARGV[7], 'history_bytes', 0, 'meta_lo', 0, 'blob_lo', 0 - tonumber(ARGV[9]),
           'transcript_bytes', 0)
local size = 0
redis.call('DEL', KEYS[2], KEYS[4], KEYS[5])
local last = 11 + tonumber(ARGV[9])
for i = 12, last do
  redis.call('RPUSH', KEYS[2], ARGV[i])
  size = size + string.len(ARGV[i])
end
if size > 0 then redis.call('HSET', KEYS[1], 'delta_bytes', size) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'owner', ARGV[5]) end
remember(KEYS, 0, ARGV[4], base_of(KEYS), ARGV[10])
for i = last + 1, #ARGV do transcribe(KEYS, ARGV[i], tonumber(ARGV[8])) end
touch(KEYS)
return {'meta', meta(KEYS[1])}
