-- inbox_claim.lua: check a fetched batch against the group's inbox and lease the new messages.
--
-- KEYS[1]  the group's inbox zset: member = message id text; score < 0: leased to a running handler
--          until -score Unix ms; score >= 0: processed at that Unix ms (final), for ids that are not
--          UUIDv7/v8 and for records written before the buckets existed (read until trimmed)
--          The processed UUIDv7/v8 ids are in buckets named after KEYS[1] (inbox_store.lua, included
--          below; every key shares KEYS[1]'s hash tag, so a Cluster routes them together).
-- ARGV[1]  now, Unix ms
-- ARGV[2]  lease length, ms
-- ARGV[3]  n, first-delivery ids (they respect a live lease held elsewhere); the rest are redelivered
--          ids (their previous holder timed out or is us: take over)
-- ARGV[4]  the group's dedup window, ms (stored in <inbox>:info for the scripts that record ids;
--          0 leaves it as it is)
-- ARGV[5]  c, the number of ids
-- ARGV[6 .. 5+c]      message ids (text), first deliveries first
-- ARGV[6+c]           the same ids' 16-byte records, in one string (broker.redis.keys.inbox_records)
-- Returns one status per id, in order: 0 = leased to the caller (run it), 1 = already processed
-- (a duplicate: ack it without running), 2 = being processed elsewhere under a live lease.
-- One ZMSCORE and one variadic ZADD per 1000 ids (not one call per id) keep the cost per message low;
-- the buckets are checked with one HMGET per bucket the batch's ids fall in (a handful per batch).
--#include inbox_store
local now = tonumber(ARGV[1])
local lease = -(now + tonumber(ARGV[2]))
local n = tonumber(ARGV[3])
local c = tonumber(ARGV[5])
local window = ARGV[4]
if window ~= '0' and redis.call('HGET', KEYS[1] .. ':info', 'window') ~= window then
  redis.call('HSET', KEYS[1] .. ':info', 'window', window)
end
-- unpack() fails beyond about 8000 values (Lua's C stack) and a fetch may hold more (2 x prefetch):
-- every variadic call goes in chunks of 1000 ids.
local CHUNK = 1000
local scores = {}
for first = 6, 5 + c, CHUNK do
  local part = redis.call('ZMSCORE', KEYS[1], unpack(ARGV, first, math.min(first + CHUNK - 1, 5 + c)))
  for j = 1, #part do scores[first - 6 + j] = part[j] end
end
local seen = inbox_seen_many(KEYS[1], ARGV[6 + c], c)
local out, zadd, taken = {}, {}, {}
local z = 0
for i = 1, c do
  local id = ARGV[i + 5]
  local s = scores[i]
  if s then s = tonumber(s) end
  if (s and s >= 0) or seen[i] then
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
