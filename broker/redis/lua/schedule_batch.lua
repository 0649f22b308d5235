-- schedule_batch.lua: store many messages of one partition to be delivered at their due times.
--
-- KEYS[1]  the partition's scheduled zset (member = message id, score = due, Unix ms)
-- KEYS[2]  the partition's scheduled envelopes hash (message id -> cmsgpack of the entry's field/value list)
-- ARGV     for each message: its id, its due time (Unix ms), its number of field/value arguments c, then
--          the c arguments
-- Returns the ids, in order (an id scheduled already keeps its first schedule). Messages carrying an
-- idempotency key go through schedule_add.lua instead. One partition per call keeps it Cluster-safe.
local out = {}
local i = 1
while i <= #ARGV do
  local id, due, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if not redis.call('ZSCORE', KEYS[1], id) then
    redis.call('ZADD', KEYS[1], due, id)
    redis.call('HSET', KEYS[2], id, cmsgpack.pack({unpack(ARGV, i + 3, i + 2 + n)}))
  end
  out[#out + 1] = id
  i = i + n + 3
end
return out
