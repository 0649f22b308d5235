-- read_hashes.lua: the same fields of several hashes in one call (one reply for all).
--
-- KEYS      the hashes (on a Cluster they share a hash tag: a saga queue partition's states)
-- ARGV      the fields
-- Returns one entry per key: the array HMGET gives (nil for a missing field or hash), or false
-- (nil) for a key HMGET refuses (not a hash): that key's reader reads it itself and sees why.
local out = {}
for i = 1, #KEYS do
  local row = redis.pcall('HMGET', KEYS[i], unpack(ARGV))
  if type(row) == 'table' and row.err then row = false end
  out[i] = row
end
return out
