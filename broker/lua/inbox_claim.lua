-- inbox_claim.lua: check a fetched batch against the group's inbox and lease the new messages.
--
-- KEYS[1]  the group's inbox zset: member = message id; score >= 0: processed at that Unix ms
--          (final); score < 0: leased to a running handler until -score Unix ms
-- ARGV[1]  now, Unix ms
-- ARGV[2]  lease length, ms
-- ARGV[3]  n, first-delivery ids that follow (they respect a live lease held elsewhere)
-- ARGV[4 .. 3+n]   first-delivery message ids
-- ARGV[4+n .. end] redelivered message ids (their previous holder timed out or is us: take over)
-- Returns one status per id, in order: 0 = leased to the caller (run it), 1 = already processed
-- (a duplicate: ack it without running), 2 = being processed elsewhere under a live lease.
-- One ZMSCORE and one variadic ZADD for the whole batch keep the cost per message low.
local now = tonumber(ARGV[1])
local lease = -(now + tonumber(ARGV[2]))
local n = tonumber(ARGV[3])
local ids = {}
for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
local scores = redis.call('ZMSCORE', KEYS[1], unpack(ids))
local out = {}
local zadd = {}
local taken = {}
for i = 1, #ids do
  local id = ids[i]
  local s = scores[i] and tonumber(scores[i])
  if s and s >= 0 then
    out[i] = 1
  elseif (s and -s > now and i <= n) or taken[id] then
    out[i] = 2  -- a live lease elsewhere, or a second copy in this very batch (the first one runs)
  else
    taken[id] = true
    zadd[#zadd + 1] = lease
    zadd[#zadd + 1] = id
    out[i] = 0
  end
end
if #zadd > 0 then redis.call('ZADD', KEYS[1], unpack(zadd)) end
return out
