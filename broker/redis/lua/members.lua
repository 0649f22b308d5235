-- members.lua: heartbeat of one instance of a group, and the group's live instances.
--
-- KEYS[1]  the group's members zset on a destination: member = instance, score = server ms its
--          heartbeat ends (instances whose heartbeat ended are removed here)
-- ARGV[1]  instance
-- ARGV[2]  heartbeat length, ms
-- ARGV[3]  '1' to join or beat, '0' to leave
-- Returns the live instances, sorted (every instance computes the same assignment from them).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 10)
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(live)
return live
