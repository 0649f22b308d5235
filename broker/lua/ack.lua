-- ack.lua: acknowledge processed entries of one stream, and make their inbox records final.
--
-- KEYS[1]  stream the entries were read from (a partition stream or a group's redeliver stream)
-- KEYS[2]  the group's inbox zset (leases; see inbox_claim.lua). A UUIDv7/v8 id is recorded in the
--          inbox's buckets (inbox_store.lua) and its lease removed; any other id gets a final score
--          (now) in the zset, replacing its lease
-- KEYS[3]  the group's attempts hash  (message id -> attempts started on redeliveries)
-- KEYS[4]  the partition's lease hash for the group (lease.lua): the fencing check (optional: no
--          check without it)
-- ARGV[#ARGV]  with KEYS[4]: the caller's fencing token, or '' when the partition is not owned (no check)
-- ARGV[1]  group
-- ARGV[2]  "1" to XDEL the entries after XACK (queues, redeliver streams), "0" to keep them (topics)
-- ARGV[3]  now, Unix ms
-- ARGV[4]  n, entry ids that follow
-- ARGV[5]  m, message ids to record in the inbox that follow the entry ids (0 when the inbox is off)
-- ARGV[6]  k, message ids whose attempt counters to drop, after those
-- ARGV[7 ..]  the n entry ids, the m inbox ids (text), one string of their m 16-byte records
--             (broker.keys.inbox_records; '' when m is 0), the k counter ids
-- Returns the number of entries acknowledged, or -1 (nothing done) when the fencing token is not current.
--#include inbox_store
local fence = KEYS[4] and ARGV[#ARGV] or ''
if fence ~= '' and redis.call('HGET', KEYS[4], 'token') ~= fence then return -1 end  -- fenced: no effect
local n, m, k = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
-- unpack(ARGV, from, to) passes slices without copying them into tables first
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 7, 6 + n))
if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], unpack(ARGV, 7, 6 + n)) end
if m > 0 then
  local base, recs = 6 + n, ARGV[7 + n + m]
  inbox_record_all(recs, m)
  inbox_flush(KEYS[2])
  if not string.find(recs, INBOX_ZERO, 1, true) then  -- every id a UUIDv7/v8 (the common case): no loop
    redis.call('ZREM', KEYS[2], unpack(ARGV, base + 1, base + m))  -- their leases
  else
    local zadd, zrem, now = {}, {}, tonumber(ARGV[3])
    for i = 1, m do
      if string.byte(recs, i * 16 - 9) ~= 0 then  -- (byte 7 of record i, the id's version: 0 in a zero record)
        zrem[#zrem + 1] = ARGV[base + i]
      else
        zadd[#zadd + 1] = now + i / 1024  -- a fraction of a ms apart: distinct scores insert faster than ties
        zadd[#zadd + 1] = ARGV[base + i]
      end
    end
    if #zrem > 0 then redis.call('ZREM', KEYS[2], unpack(zrem)) end
    if #zadd > 0 then redis.call('ZADD', KEYS[2], unpack(zadd)) end
  end
end
if k > 0 then
  redis.call('HDEL', KEYS[3], unpack(ARGV, 8 + n + m, 7 + n + m + k))
end
return acked
