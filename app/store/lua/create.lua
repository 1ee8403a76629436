--! uses: now session
-- A new session. KEYS: the session's six. ARGV: ttl, model, fingerprint, n_tokens, owner,
-- commit id, versions to keep, transcript bound, number of deltas D, the tokens' hash
-- (app/prefixes.py; '' if unknown), snapshot, D deltas, transcript segments...: each of
-- the snapshot and the deltas becomes a page (session.lua), named by the commit id.
-- Returns {'meta', meta}, or false when the id is taken: by another session, for a retry
-- that finds its own commit id there (its first run's answer was lost) answers as that run did.
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'commit') == ARGV[6] then return {'meta', meta(KEYS[1])} end
  return false
end
-- the first write must be one Redis refuses over maxmemory (SET, not DEL): after a
-- script's first write, Redis lets the rest through, so a full Redis would take it all
put_page(KEYS, ARGV[6], ARGV[11])
local last = 11 + tonumber(ARGV[9])
local deltas = {}
for i = 12, last do
  table.insert(deltas, ARGV[6] .. '.' .. (i - 11))
  put_page(KEYS, deltas[#deltas], ARGV[i])
end
found(KEYS, {ttl = ARGV[1], model = ARGV[2], fingerprint = ARGV[3], n_tokens = ARGV[4], owner = ARGV[5],
             commit = ARGV[6], keep = ARGV[7], tokens = ARGV[10]}, ARGV[6], deltas)
for i = last + 1, #ARGV do transcribe(KEYS, ARGV[i], tonumber(ARGV[8])) end
touch(KEYS)
return {'meta', meta(KEYS[1])}
