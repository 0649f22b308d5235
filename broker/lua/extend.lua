-- extend.lua: reset the idle time of entries a consumer still owns, so they are not claimed away,
-- and push out the inbox leases of their messages.
--
-- KEYS[1]  stream
-- KEYS[2]  the group's inbox zset (leases have negative scores; see inbox_claim.lua)
-- ARGV[1]  group
-- ARGV[2]  consumer
-- ARGV[3]  new lease expiry, Unix ms
-- ARGV[4]  n, entry ids that follow; then n message ids ("" where unknown), in the same order
-- Returns the entry ids still owned (and now touched); entries another consumer claimed are left alone.
local n = tonumber(ARGV[4])
local owned = {}
for i = 1, n do
  local eid = ARGV[4 + i]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    owned[#owned + 1] = eid
    local mid = ARGV[4 + n + i]
    if mid ~= '' then
      local s = redis.call('ZSCORE', KEYS[2], mid)
      if s and tonumber(s) < 0 then redis.call('ZADD', KEYS[2], -tonumber(ARGV[3]), mid) end
    end
  end
end
if #owned > 0 then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(owned), 'JUSTID')
end
return owned
