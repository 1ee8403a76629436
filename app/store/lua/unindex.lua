-- Drop a deleted session's entries from its tenant's prefix index. KEYS: the entries.
-- ARGV: the session id. An entry another session has taken since stays. Returns
-- {'status', 'ok', 'dropped', n}.
local n = 0
for _, key in ipairs(KEYS) do
  local entry = redis.call('GET', key)
  if entry and string.sub(entry, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
    redis.call('DEL', key)
    n = n + 1
  end
end
return {'status', 'ok', 'dropped', n}
