-- move_due.lua: deliver due delayed retries to their group only, each exactly once.
--
-- KEYS[1]  the group's delayed zset
-- KEYS[2]  the group's redeliver stream (read by that group alone)
-- ARGV[1]  now, Unix ms
-- ARGV[2]  at most this many entries per call
-- Returns the number moved. Atomic, so several schedulers may run it at once without a double move.
local due = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
for i = 1, #due do
  redis.call('XADD', KEYS[2], '*', unpack(cmsgpack.unpack(due[i])))
  redis.call('ZREM', KEYS[1], due[i])
end
return #due
