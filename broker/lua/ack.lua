-- ack.lua: acknowledge processed entries of one stream, and make their inbox records final.
--
-- KEYS[1]  stream the entries were read from (a partition stream or a group's redeliver stream)
-- KEYS[2]  the group's inbox zset   (member = message id, score = processed-at ms)
-- KEYS[3]  the group's leases zset  (member = message id, score = lease expiry ms)
-- ARGV[1]  group
-- ARGV[2]  "1" to XDEL the entries after XACK (queues, redeliver streams), "0" to keep them (topics)
-- ARGV[3]  now, Unix ms
-- ARGV[4]  n, the number of entry ids that follow
-- ARGV[5 .. 4+n]      entry ids to acknowledge
-- ARGV[5+n .. end]    message ids to record in the inbox (none when the inbox is off)
-- Returns the number of entries acknowledged.
local n = tonumber(ARGV[4])
local ids = {}
for i = 1, n do ids[i] = ARGV[4 + i] end
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], unpack(ids)) end
local marks = #ARGV - 4 - n
if marks > 0 then
  local now = ARGV[3]
  local zadd = {}
  local zrem = {}
  for i = 1, marks do
    local mid = ARGV[4 + n + i]
    zadd[#zadd + 1] = now
    zadd[#zadd + 1] = mid
    zrem[#zrem + 1] = mid
  end
  redis.call('ZADD', KEYS[2], unpack(zadd))
  redis.call('ZREM', KEYS[3], unpack(zrem))
end
return acked
