-- trim.lua: apply a topic partition's retention without passing any group's unacknowledged entry.
--
-- KEYS[1]  the partition stream
-- ARGV[1]  time cutoff: entries with ids below it are old enough to drop ("0" = no time limit)
-- ARGV[2]  max length (0 = no length limit)
-- ARGV[3]  at most this many entries removed for length per call (keeps the script short)
-- The cutoff is lowered to every group's first pending entry and to the entry after its last
-- delivered one, then XTRIM MINID (exact) applies it. Works on any Redis >= 6.2 or Valkey.
-- Returns the number of entries removed.
local function parse(id)
  local dash = string.find(id, '-', 1, true)
  if not dash then return tonumber(id), 0 end
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
local cutoff = ARGV[1]
local maxlen = tonumber(ARGV[2])
if maxlen > 0 then
  local excess = redis.call('XLEN', KEYS[1]) - maxlen
  if excess > 0 then
    excess = math.min(excess, tonumber(ARGV[3]))
    local head = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', excess + 1)
    if #head == excess + 1 and less(cutoff, head[excess + 1][1]) then cutoff = head[excess + 1][1] end
  end
end
if cutoff == '0' then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
for g = 1, #groups do
  local info = groups[g]
  local name, last, pending
  for i = 1, #info, 2 do
    if info[i] == 'name' then name = info[i + 1]
    elseif info[i] == 'last-delivered-id' then last = info[i + 1]
    elseif info[i] == 'pending' then pending = info[i + 1] end
  end
  local ms, seq = parse(last)
  local after_last = string.format('%.0f-%.0f', ms, seq + 1)
  if less(after_last, cutoff) then cutoff = after_last end
  if pending > 0 then
    local first = redis.call('XPENDING', KEYS[1], name, '-', '+', 1)
    if #first == 1 and less(first[1][1], cutoff) then cutoff = first[1][1] end
  end
end
return redis.call('XTRIM', KEYS[1], 'MINID', cutoff)
