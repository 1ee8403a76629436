-- The first of a tenant's prefix keys that exists. KEYS: candidate prefix keys, longest
-- prefix first (one tenant's: one slot). Returns {'index', i, 'entry', 'session_id:version'}
-- or false.
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v then return {'index', i, 'entry', v} end
end
return false
