-- commit_effects.lua: apply a handler's Redis writes, its outgoing messages, the inbox mark and the
-- ack in one atomic step, unless the message was already processed (then only ack it).
--
-- KEYS[1]  stream the entry was read from
-- KEYS[2]  the group's inbox zset (a score >= 0 means processed; see inbox_claim.lua)
-- KEYS[3]  the group's attempts hash
-- KEYS[4 ..]  the keys the writes and outgoing messages touch (declared for Cluster routing)
-- ARGV[1]  group
-- ARGV[2]  "1" to XDEL the entry after XACK
-- ARGV[3]  now, Unix ms
-- ARGV[4]  entry id
-- ARGV[5]  message id
-- ARGV[6]  number of commands that follow; each is: argument count c, then c arguments
--          (outgoing messages are XADD commands among them)
-- Returns 1 when the effects were applied, 0 when the message was a duplicate.
local s = redis.call('ZSCORE', KEYS[2], ARGV[5])
local done = s and tonumber(s) >= 0
if not done then
  local pos = 7
  for _ = 1, tonumber(ARGV[6]) do
    local c = tonumber(ARGV[pos])
    local cmd = {}
    for j = 1, c do cmd[j] = ARGV[pos + j] end
    redis.call(unpack(cmd))
    pos = pos + c + 1
  end
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[5])
end
redis.call('HDEL', KEYS[3], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[4])
if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], ARGV[4]) end
if done then return 0 end
return 1
