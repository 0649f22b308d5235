-- intake.lua: read new entries of a group's partition and lease their messages in the inbox, in
-- one call: the lease rides on the read (no second round trip before the handlers start).
--
-- KEYS[1]  the partition stream
-- KEYS[2]  the group's redeliver stream for the partition
-- KEYS[3]  the group's inbox zset (inbox_claim.lua)
-- KEYS[4]  the partition's lease hash for the group (lease.lua: owner, token); read only when fenced
-- ARGV[1]  the consumer (and, fenced, the lease's owner)
-- ARGV[2]  the group
-- ARGV[3]  count
-- ARGV[4]  now, Unix ms
-- ARGV[5]  lease length, ms
-- ARGV[6]  the group's dedup window, ms ('0' leaves the stored one)
-- ARGV[7]  the caller's fencing token, or '' when the partition is not owned (no check)
-- XREADGROUP '>' of both streams (never blocking), then inbox_lease.lua over the entries' message
-- ids (their records made here, as broker.redis.keys.inbox_record makes them). Returns
--   {1, reply, statuses[, last id of KEYS[1], of KEYS[2]]}: the XREADGROUP reply and one status per
--                         entry in reply order (0 run, 1 duplicate, 2 elsewhere; 0 with no lease for an
--                         entry without an id field); the last ids when fewer than count came back
--                         (the streams were read to their end: the caller's next wait starts there)
--   {0, last id of KEYS[1], last id of KEYS[2]}: nothing new (the caller may XREAD BLOCK from them)
--   {-1}: fenced out (the lease's owner or token is not the caller's): nothing taken
-- The server copies the reply through Lua (about 2 µs per entry): the caller uses this for small
-- reads (the latency path) and a plain XREADGROUP + inbox_claim.lua for backlogs.
--#include inbox_read
--#include inbox_lease
if ARGV[7] ~= '' then
  local state = redis.call('HMGET', KEYS[4], 'owner', 'token')
  if state[1] ~= ARGV[1] or tonumber(state[2] or '0') ~= tonumber(ARGV[7]) then return {-1} end
end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[1], 'COUNT', ARGV[3],
  'STREAMS', KEYS[1], KEYS[2], '>', '>')
-- The streams' last ids, into out[at], out[at + 1]: where a wait for what comes next starts. A
-- stream this read took entries from was read to its end: its last entry read is that id (an
-- entry added and deleted after it is gone: a wait from there misses nothing). An empty stream
-- (a queue's, once its entries are acknowledged: they are deleted; a redeliver stream, mostly)
-- waits from 0-0: whatever it holds when the wait starts came after this read. Any other
-- stream's is its last generated id (XINFO STREAM: several us of server time, on the latency path).
local function last_ids(out, at, known)
  for i = 1, 2 do
    local id = known and known[KEYS[i]]
    if not id and redis.call('XLEN', KEYS[i]) == 0 then id = '0-0' end
    if not id then
      local info = redis.call('XINFO', 'STREAM', KEYS[i])
      for j = 1, #info, 2 do
        if info[j] == 'last-generated-id' then id = info[j + 1] end
      end
    end
    out[at + i - 1] = id
  end
  return out
end
if not reply then return last_ids({0}, 2) end
local ids, recs, at = {}, {}, {}  -- the ids found, their records, their positions among the entries
local total = 0
local lo, hi, timed = 1 / 0, -1, true  -- the ids' lowest and highest time, while every one has one
local last = {}  -- stream name -> the id of its last entry read
for _, stream in ipairs(reply) do
  local entries = stream[2]
  if #entries > 0 then last[stream[1]] = entries[#entries][1] end
  for _, entry in ipairs(entries) do
    total = total + 1
    local f = entry[2]
    local id = nil
    if f[1] == 'id' then
      id = f[2]
    else
      for j = 1, #f - 1, 2 do
        if f[j] == 'id' then id = f[j + 1]; break end
      end
    end
    if id then
      local rec = inbox_record_of(id)
      ids[#ids + 1] = id
      recs[#recs + 1] = rec
      at[#at + 1] = total
      local t = timed and inbox_t(rec, 0)
      if not t then
        timed = false
      else
        if t < lo then lo = t end
        if t > hi then hi = t end
      end
    end
  end
end
local statuses = {}
for i = 1, total do statuses[i] = 0 end
if #ids > 0 then
  -- (with the ids' span, a read newer than everything the slot recorded skips its lookups)
  local got, fresh = inbox_lease(KEYS[3], tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ids, 0, #ids, #ids,
    table.concat(recs), timed and lo or nil, timed and hi or nil)
  if not fresh then
    for i = 1, #ids do statuses[at[i]] = got[i] end
  end
end
local out = {1, reply, statuses}
if total < tonumber(ARGV[3]) then last_ids(out, 4, last) end  -- both streams read to their end: where a wait starts
return out
