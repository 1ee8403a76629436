--! uses: now session
-- A new session holding a kept version of another of its family (one hash slot): it names
-- that version's pages (session.lua), and copies no state. KEYS: the source's six, then the
-- new session's five (its pages are the source's KEYS[6]). ARGV: owner, the version, its
-- tokens' hash as the caller read it ('' for any), ttl, commit id, versions to keep,
-- transcript bound, the new session's transcript segments... Returns {'status', 'ok',
-- 'meta', meta}, {'status', 'missing'}, {'status', 'gone', 'oldest', v} (the version is no
-- longer kept, or is not the one read) or {'status', 'taken'}; a retry that finds its own
-- commit id there (its first run's answer was lost) answers as that run did.
local new = {KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[6]}
if redis.call('EXISTS', new[1]) == 1 then
  if redis.call('HGET', new[1], 'commit') == ARGV[5] then return {'status', 'ok', 'meta', meta(new[1])} end
  return {'status', 'taken'}
end
if not owned(KEYS[1], ARGV[1]) then return {'status', 'missing'} end
upgrade(KEYS)
local v = tonumber(ARGV[2])
local n, _, h = kept(KEYS, v)
if not n or (ARGV[3] ~= '' and h ~= ARGV[3]) then
  return {'status', 'gone', 'oldest', tostring(oldest_kept(KEYS, num(KEYS[1], 'version')))}
end
local snapshot, deltas = pages_at(KEYS, v)
-- (the first write is one a full Redis refuses: HSET, in `found`, before the names)
found(new, {ttl = ARGV[4], model = redis.call('HGET', KEYS[1], 'model'),
            fingerprint = redis.call('HGET', KEYS[1], 'fingerprint'), n_tokens = n, owner = ARGV[1],
            commit = ARGV[5], keep = ARGV[6], tokens = h}, snapshot, deltas)
name_page(KEYS, snapshot)
for _, id in ipairs(deltas) do name_page(KEYS, id) end
for i = 8, #ARGV do transcribe(new, ARGV[i], tonumber(ARGV[7])) end
touch(new)  -- (and the pages it names; the source was re-armed by the read before)
return {'status', 'ok', 'meta', meta(new[1])}
