-- inbox_claim.lua: check a fetched batch against the group's inbox and lease the new messages.
--
-- KEYS[1]  the group's inbox zset: member = message id; score >= 0: processed at that Unix ms
--          (final); score < 0: leased to a running handler until -score Unix ms
-- ARGV[1]  now, Unix ms
-- ARGV[2]  lease length, ms
-- ARGV[3]  n, first-delivery ids that follow (they respect a live lease held elsewhere)
-- ARGV[4 .. 3+n]   first-delivery message ids
-- ARGV[4+n .. end] redelivered message ids (their previous holder timed out or is us: take over)
-- Returns one status per id, in order: 0 = leased to the caller (run it), 1 = already processed
-- (a duplicate: ack it without running), 2 = being processed elsewhere under a live lease.
-- One ZMSCORE and one variadic ZADD per 1000 ids (not one call per id) keep the cost per message low.
local now = tonumber(ARGV[1])
local lease = -(now + tonumber(ARGV[2]))
local n = tonumber(ARGV[3])
-- unpack() fails beyond about 8000 values (Lua's C stack) and a fetch may hold more (2 x prefetch):
-- every variadic call goes in chunks of 1000 ids.
local CHUNK = 1000
local scores = {}
for first = 4, #ARGV, CHUNK do
  local part = redis.call('ZMSCORE', KEYS[1], unpack(ARGV, first, math.min(first + CHUNK - 1, #ARGV)))
  for j = 1, #part do scores[first - 4 + j] = part[j] end
end
local out, zadd, taken = {}, {}, {}
local z = 0
for i = 1, #ARGV - 3 do
  local id = ARGV[i + 3]
  local s = scores[i]
  if s then s = tonumber(s) end
  if s and s >= 0 then
    out[i] = 1
  elseif (s and -s > now and i <= n) or taken[id] then
    out[i] = 2  -- a live lease elsewhere, or a second copy in this very batch (the first one runs)
  else
    taken[id] = true
    zadd[z + 1] = lease - i / 1024  -- distinct scores insert faster than ties (no member compares)
    zadd[z + 2] = id
    z = z + 2
    out[i] = 0
  end
end
for first = 1, z, 2 * CHUNK do
  redis.call('ZADD', KEYS[1], unpack(zadd, first, math.min(first + 2 * CHUNK - 1, z)))
end
return out
