-- publish_batch.lua: append many entries to one stream in one call (one reply instead of one per entry).
--
-- KEYS[1]  the partition stream
-- ARGV     for each entry: its number of field/value arguments c, then the c arguments
-- Returns the new entry ids, in order. One stream per call keeps it Cluster-safe.
local out = {}
local i = 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  out[#out + 1] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return out
