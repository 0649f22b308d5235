-- extend.lua: reset the idle time of entries a consumer still owns, so they are not claimed away,
-- and push out the inbox leases of their messages.
--
-- KEYS[1]  stream
-- KEYS[2]  the group's inbox zset (leases have negative scores; see inbox_claim.lua)
-- ARGV[1]  group
-- ARGV[2]  consumer
-- ARGV[3]  new lease expiry, Unix ms
-- ARGV[4]  n, entry ids that follow; then n message ids ("" where unknown), in the same order
-- Returns one status per entry id, in order: 0 = still owned by the consumer (touched now),
-- 1 = no longer pending in the group (settled: acked, retried or dead-lettered meanwhile),
-- 2 = pending under another consumer (claimed away; left alone, as is its inbox lease).
local n = tonumber(ARGV[4])
local out, owned = {}, {}
for i = 1, n do
  local eid = ARGV[4 + i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1)
  if #p == 0 then
    out[i] = 1
  elseif p[1][2] ~= ARGV[2] then
    out[i] = 2
  else
    out[i] = 0
    owned[#owned + 1] = eid
    local mid = ARGV[4 + n + i]
    if mid ~= '' then
      local s = redis.call('ZSCORE', KEYS[2], mid)
      if s and tonumber(s) < 0 then redis.call('ZADD', KEYS[2], -tonumber(ARGV[3]), mid) end
    end
  end
end
-- unpack() must come last in an argument list (elsewhere it yields only its first value), and
-- it fails beyond about 8000 values (Lua's C stack): so JUSTID goes into the table, in chunks.
for first = 1, #owned, 1000 do
  local ids = {}
  for j = first, math.min(first + 999, #owned) do ids[#ids + 1] = owned[j] end
  ids[#ids + 1] = 'JUSTID'
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(ids))
end
return out
