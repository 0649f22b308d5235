-- publish_once.lua: XADD a message unless its producer idempotency key is still in its dedup window.
--
-- KEYS[1]  the partition stream
-- KEYS[2]  the partition's published-keys zset (member = idempotency key, score = expiry, Unix ms)
-- ARGV[1]  idempotency key
-- ARGV[2]  now, Unix ms
-- ARGV[3]  dedup window, ms (<= 0: publish without recording the key)
-- ARGV[4 .. end]  field/value pairs of the entry
-- Returns the new entry id, or false when the key was stored before and has not expired.
--
-- A key's score is its expiry (the storing publish's now + window): a repeat is a duplicate while
-- score > now, whatever window the repeat asks for, and does not extend the expiry. Each call first
-- removes up to 100 expired keys (each key is added once and removed once, so the cost is amortised,
-- and a large backlog, e.g. after a bulk load's keys expire together, never stalls one call), and
-- keeps the zset's own TTL beyond its latest expiry (by a minute: producers' clocks may run ahead of
-- the server's), so a partition nobody publishes to any more frees it entirely. RedisBroker.trim
-- also removes expired keys on partitions a service consumes.
local now = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 100)
if #expired > 0 then redis.call('ZREM', KEYS[2], unpack(expired)) end
local seen = redis.call('ZSCORE', KEYS[2], ARGV[1])
if seen and tonumber(seen) > now then return false end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[1], '*', unpack(fields))
if window > 0 then
  redis.call('ZADD', KEYS[2], now + window, ARGV[1])
  if redis.call('PTTL', KEYS[2]) < window then redis.call('PEXPIRE', KEYS[2], window + 60000) end
end
return id
