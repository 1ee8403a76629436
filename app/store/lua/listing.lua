--! uses: now ledger
-- A page of a tenant's sessions, newest first. KEYS: live, bytes, made. ARGV: the cursor's
-- microseconds ('' for the first page) and entry ('s:' or 'e:' .. id), how many, '1' to
-- include ephemeral sessions. Returns {'ids', [id...], 'ephemeral', ['0'|'1'...], 'next',
-- microseconds, 'after', entry} for the last entry looked at ('' when no more). At most SCAN entries are
-- looked at per call, so a page of a tenant with many hidden ephemeral sessions may come
-- back short (its `next` goes on).
local SCAN = 2000
prune_ledger(KEYS[1], KEYS[2], KEYS[3])
local top, after, want, all = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'
local ids, kinds, seen, last, entry = {}, {}, 0, '', ''
local max = top == '' and '+inf' or top
while #ids < want and seen < SCAN do
  local batch = redis.call('ZREVRANGEBYSCORE', KEYS[3], max, '-inf', 'WITHSCORES', 'LIMIT', seen, 4 * want)
  if #batch == 0 then last = ''; break end
  for i = 1, #batch, 2 do
    local member, score = batch[i], batch[i + 1]
    local sid, eph = string.sub(member, 3), string.sub(member, 1, 1) == 'e'
    seen = seen + 1
    -- (entries of the cursor's own microsecond come in descending order: those down to the
    -- cursor's entry were on an earlier page)
    local done = top ~= '' and score == top and member >= after
    if not done and (all or not eph) then
      table.insert(ids, sid)
      table.insert(kinds, eph and '1' or '0')
    end
    last, entry = score, member
    if #ids >= want then break end
  end
end
if #ids < want and seen < SCAN then last = '' end
return {'ids', ids, 'ephemeral', kinds, 'next', last, 'after', entry}
