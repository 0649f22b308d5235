-- schedule_cancel.lua: drop scheduled messages before they are delivered.
--
-- KEYS[1]  the partition's scheduled zset (member = message id, score = due, Unix ms)
-- KEYS[2]  the partition's scheduled envelopes hash
-- ARGV     message ids
-- Returns how many were scheduled here (and are now cancelled). Atomic with schedule_move.lua: a
-- message is either delivered or cancelled, never both.
local n = 0
for i = 1, #ARGV do
  n = n + redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
end
return n
