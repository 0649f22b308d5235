-- retry_later.lua: park one entry in its group's delayed-retry set, atomically with its ack.
--
-- KEYS[1]  stream the entry was read from
-- KEYS[2]  the group's delayed zset (member = cmsgpack of the entry's field/value list, score = due ms)
-- KEYS[3]  the group's inbox zset (the message's lease, if it holds one, is released)
-- KEYS[4]  the group's attempts hash (the message's counter is dropped)
-- KEYS[5]  the partition's lease hash for the group (lease.lua): the fencing check
-- ARGV[#ARGV]  the caller's fencing token, or '' when the partition is not owned (no check)
-- ARGV[1]  group
-- ARGV[2]  entry id
-- ARGV[3]  "1" to XDEL the entry after XACK, "0" to keep it
-- ARGV[4]  due time, Unix ms
-- ARGV[5]  message id
-- ARGV[6 .. #ARGV - 1]  field/value pairs to deliver again (attempt already raised)
-- Returns 1, or 0 when the entry is no longer pending for the group, or -1 (nothing done) when the
-- fencing token is not current.
local fence = ARGV[#ARGV]
if fence ~= '' and redis.call('HGET', KEYS[5], 'token') ~= fence then return -1 end  -- fenced: no effect
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then return 0 end
local fields = {}
for i = 6, #ARGV - 1 do fields[#fields + 1] = ARGV[i] end
redis.call('ZADD', KEYS[2], ARGV[4], cmsgpack.pack(fields))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] == '1' then redis.call('XDEL', KEYS[1], ARGV[2]) end
if ARGV[5] ~= '' then
  local s = redis.call('ZSCORE', KEYS[3], ARGV[5])
  if s and tonumber(s) < 0 then redis.call('ZREM', KEYS[3], ARGV[5]) end
  redis.call('HDEL', KEYS[4], ARGV[5])
end
return 1
