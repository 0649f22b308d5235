-- reply_open.lua: create a requester's reply stream (empty) if it does not exist, and push its expiry back.
--
-- KEYS[1]  the reply stream (broker.redis.replies: <namespace>:reply:{<name>})
-- ARGV[1]  time to live, ms
-- Returns 1 when the stream was created, 0 when it existed.
local created = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  -- an empty stream is still a key: add one entry and trim it away
  redis.call('XADD', KEYS[1], '*', 'open', '1')
  redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)
  created = 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return created
