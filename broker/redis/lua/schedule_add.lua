-- schedule_add.lua: store one message to be delivered to its partition stream at a due time.
--
-- KEYS[1]  the partition's scheduled zset (member = message id, score = due, Unix ms)
-- KEYS[2]  the partition's scheduled envelopes hash (message id -> cmsgpack of the entry's field/value list)
-- KEYS[3]  the partition's published-keys zset (producer idempotency keys, as in publish_once.lua)
-- ARGV[1]  message id
-- ARGV[2]  due time, Unix ms
-- ARGV[3]  idempotency key, or '' for none
-- ARGV[4]  now, Unix ms
-- ARGV[5]  dedup window, ms (<= 0: do not record the idempotency key)
-- ARGV[6 .. end]  field/value pairs of the entry to deliver
-- Returns the message id (also when that id is scheduled already: the first schedule stands), or
-- false when the idempotency key was stored before and has not expired (nothing done). The zset and
-- the hash are written together, so the mover (schedule_move.lua) never sees one without the other.
local id = ARGV[1]
local idem = ARGV[3]
local now = tonumber(ARGV[4])
local window = tonumber(ARGV[5])
if idem ~= '' then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)
  if #expired > 0 then redis.call('ZREM', KEYS[3], unpack(expired)) end
  local seen = redis.call('ZSCORE', KEYS[3], idem)
  if seen and tonumber(seen) > now then return false end
end
if redis.call('ZSCORE', KEYS[1], id) then return id end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('ZADD', KEYS[1], ARGV[2], id)
redis.call('HSET', KEYS[2], id, cmsgpack.pack(fields))
if idem ~= '' and window > 0 then
  redis.call('ZADD', KEYS[3], now + window, idem)
  if redis.call('PTTL', KEYS[3]) < window then redis.call('PEXPIRE', KEYS[3], window + 60000) end
end
return id
