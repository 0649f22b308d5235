-- extend.lua: reset the idle time of entries a consumer still owns, so they are not claimed away.
--
-- KEYS[1]  stream
-- ARGV[1]  group
-- ARGV[2]  consumer
-- ARGV[3 .. end]  entry ids
-- Returns the ids still owned (and now touched); entries another consumer claimed are left alone.
local owned = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then owned[#owned + 1] = ARGV[i] end
end
if #owned > 0 then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(owned), 'JUSTID')
end
return owned
