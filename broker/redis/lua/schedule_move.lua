-- schedule_move.lua: deliver a partition's due scheduled messages to its stream, each exactly once.
--
-- KEYS[1]  the partition's scheduled zset (member = message id, score = due, Unix ms)
-- KEYS[2]  the partition's scheduled envelopes hash (message id -> cmsgpack of field/value list)
-- KEYS[3]  the partition stream
-- ARGV[1]  now, Unix ms
-- ARGV[2]  at most this many messages per call
-- Returns {moved, next due (Unix ms, as a string) or -1 when nothing is left}. Atomic: the XADD and the
-- ZREM/HDEL happen together, so several movers racing never deliver a message twice.
local due = redis.call('ZRANGE', KEYS[1], '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
for i = 1, #due do
  local packed = redis.call('HGET', KEYS[2], due[i])
  if packed then
    redis.call('XADD', KEYS[3], '*', unpack(cmsgpack.unpack(packed)))
    redis.call('HDEL', KEYS[2], due[i])
  end
  redis.call('ZREM', KEYS[1], due[i])
end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #nxt == 0 then return {#due, -1} end
return {#due, nxt[2]}
