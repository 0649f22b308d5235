-- ack.lua: acknowledge processed entries of one stream, and make their inbox records final.
--
-- KEYS[1]  stream the entries were read from (a partition stream or a group's redeliver stream)
-- KEYS[2]  the group's inbox zset     (see inbox_claim.lua; final records replace leases here)
-- KEYS[3]  the group's attempts hash  (message id -> attempts started on redeliveries)
-- ARGV[1]  group
-- ARGV[2]  "1" to XDEL the entries after XACK (queues, redeliver streams), "0" to keep them (topics)
-- ARGV[3]  now, Unix ms
-- ARGV[4]  n, entry ids that follow
-- ARGV[5]  m, message ids to record in the inbox that follow the entry ids (0 when the inbox is off)
-- ARGV[6]  k, message ids whose attempt counters to drop, after those
-- ARGV[7 ..]  the n entry ids, the m inbox ids, the k counter ids
-- Returns the number of entries acknowledged.
local n, m, k = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
-- unpack(ARGV, from, to) passes slices without copying them into tables first
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 7, 6 + n))
if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], unpack(ARGV, 7, 6 + n)) end
if m > 0 then
  local zadd, now, base = {}, tonumber(ARGV[3]), 6 + n
  for i = 1, m do
    zadd[2 * i - 1] = now + i / 1024  -- a fraction of a ms apart: distinct scores insert faster than ties
    zadd[2 * i] = ARGV[base + i]
  end
  redis.call('ZADD', KEYS[2], unpack(zadd))
end
if k > 0 then
  redis.call('HDEL', KEYS[3], unpack(ARGV, 7 + n + m, 6 + n + m + k))
end
return acked
