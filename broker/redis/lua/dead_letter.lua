-- dead_letter.lua: move one entry to its group's dead-letter stream, atomically with its ack.
--
-- KEYS[1]  stream the entry was read from
-- KEYS[2]  the group's DLQ stream
-- KEYS[3]  the group's inbox zset (the message's lease, if it holds one, is released)
-- KEYS[4]  the group's attempts hash (the message's counter is dropped)
-- KEYS[5]  the partition's lease hash for the group (lease.lua): the fencing check
-- ARGV[#ARGV]  the caller's fencing token, or '' when the partition is not owned (no check)
-- ARGV[1]  group
-- ARGV[2]  entry id
-- ARGV[3]  "1" to XDEL the entry after XACK, "0" to keep it (topic partition streams)
-- ARGV[4]  message id ("" when the entry could not be decoded)
-- ARGV[5 .. #ARGV - 1]  field/value pairs of the DLQ entry (the original fields plus the reason)
-- Returns the DLQ entry id, or false when the entry is no longer pending for the group (another
-- consumer already settled it), so a repeated call never writes a second dead letter; -1 (nothing
-- done) when the fencing token is not current.
local fence = ARGV[#ARGV]
if fence ~= '' and redis.call('HGET', KEYS[5], 'token') ~= fence then return -1 end  -- fenced: no effect
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then return false end
local fields = {}
for i = 5, #ARGV - 1 do fields[#fields + 1] = ARGV[i] end
local dead = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] == '1' then redis.call('XDEL', KEYS[1], ARGV[2]) end
if ARGV[4] ~= '' then
  local s = redis.call('ZSCORE', KEYS[3], ARGV[4])
  if s and tonumber(s) < 0 then redis.call('ZREM', KEYS[3], ARGV[4]) end
  redis.call('HDEL', KEYS[4], ARGV[4])
end
return dead
