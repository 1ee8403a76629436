--! uses: now session
-- A session and its kept versions. KEYS: the session's six. ARGV: owner. Returns
-- {'status', 'ok', 'meta', meta, 'versions', {{'version', v, 'n_tokens', n, 'committed_at', t}...}}
-- (oldest first) or {'status', 'missing'}. Re-arms the TTL.
if not owned(KEYS[1], ARGV[1]) then
  return {'status', 'missing'}
end
upgrade(KEYS)
touch(KEYS)
local current = num(KEYS[1], 'version')
local kept = {}
for v = oldest_kept(KEYS, current), current do
  local n = redis.call('HGET', KEYS[4], 'n:' .. v)
  if n then
    table.insert(kept, {'version', tostring(v), 'n_tokens', n, 'committed_at', redis.call('HGET', KEYS[4], 't:' .. v)})
  end
end
return {'status', 'ok', 'meta', meta(KEYS[1]), 'versions', kept}
