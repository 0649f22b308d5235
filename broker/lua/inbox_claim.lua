-- inbox_claim.lua: check a fetched batch against the group's inbox and lease the new messages.
--
-- KEYS[1]  the group's inbox zset   (member = message id, score = processed-at ms)
-- KEYS[2]  the group's leases zset  (member = message id, score = lease expiry ms)
-- ARGV[1]  now, Unix ms
-- ARGV[2]  lease length, ms
-- ARGV[3]  n, first-delivery ids that follow (they respect a live lease held elsewhere)
-- ARGV[4 .. 3+n]   first-delivery message ids
-- ARGV[4+n .. end] redelivered message ids (their previous holder timed out or is us: take over)
-- Returns one status per id, in order: 0 = leased to the caller (run it), 1 = already processed
-- (a duplicate: ack it without running), 2 = being processed elsewhere under a live lease.
local now = tonumber(ARGV[1])
local expiry = now + tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('ZSCORE', KEYS[1], id) then
    out[#out + 1] = 1
  else
    local lease = redis.call('ZSCORE', KEYS[2], id)
    if lease and tonumber(lease) > now and i <= 3 + n then
      out[#out + 1] = 2
    else
      redis.call('ZADD', KEYS[2], expiry, id)
      out[#out + 1] = 0
    end
  end
end
return out
