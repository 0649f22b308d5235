-- publish_once.lua: XADD a message unless its producer idempotency key was seen in the window.
--
-- KEYS[1]  the partition stream
-- KEYS[2]  the partition's published-keys zset (member = idempotency key, score = publish ms)
-- ARGV[1]  idempotency key
-- ARGV[2]  now, Unix ms
-- ARGV[3]  dedup window, ms
-- ARGV[4 .. end]  field/value pairs of the entry
-- Returns the new entry id, or false when the key was published inside the window.
-- Keys older than the window are removed by the retention job (RedisBroker.trim).
local now = tonumber(ARGV[2])
local seen = redis.call('ZSCORE', KEYS[2], ARGV[1])
if seen and tonumber(seen) > now - tonumber(ARGV[3]) then return false end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('ZADD', KEYS[2], now, ARGV[1])
return id
