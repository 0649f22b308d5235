-- ack.lua: acknowledge processed entries of one stream, and make their inbox records final.
--
-- KEYS[1]  stream the entries were read from (a partition stream or a group's redeliver stream)
-- KEYS[2]  the group's inbox zset (leases; see inbox_claim.lua). A UUIDv7/v8 id is recorded in the
--          inbox's buckets (inbox_store.lua) and its lease removed; any other id gets a final score
--          (now) in the zset, replacing its lease
-- KEYS[3]  the group's attempts hash  (message id -> attempts started on redeliveries)
-- KEYS[4]  the partition's lease hash for the group (lease.lua): the fencing check (optional: no
--          check without it)
-- ARGV[#ARGV]  with KEYS[4]: the caller's fencing token, or '' when the partition is not owned (no check)
-- ARGV[1]  group
-- ARGV[2]  "1" to delete the entries after XACK (queues, redeliver streams: stream_drop.lua), "0" to
--          keep them (topics)
-- ARGV[3]  now, Unix ms
-- ARGV[4]  n, entry ids that follow
-- ARGV[5]  m, message ids to record in the inbox that follow the entry ids (0 when the inbox is off)
-- ARGV[6]  k, message ids whose attempt counters to drop, after those
-- ARGV[7 ..]  the n entry ids, the m inbox ids (text), one string of their m 16-byte records
--             (broker.redis.keys.inbox_records; '' when m is 0), the k counter ids, then w: guarded writes
--             (broker.protocol.GuardedWrite) that follow. With w > 0: a string of three 16-bit
--             big-endian numbers per write (the index of its entry 1..n, of its inbox id 1..m or 0
--             for none, of its shape 1..s), s, then s shapes (p, the guard field, the p field names
--             to HSET), then per write the value its guard must hold ('' = absent) and its p values;
--             KEYS[4 + j] is write j's hash
-- A guarded write is applied before the acks, unless its entry is no longer pending or its message
-- was processed before (both: skipped, the entry acknowledged as usual; on a fenced call an entry
-- whose message id is recorded is checked by that record alone); when its guard field does
-- not hold the value, or the server refuses the write, nothing is written and its entry is left
-- pending, not acknowledged nor recorded in the inbox (the caller runs it again).
-- Returns the number of entries acknowledged, or -1 (nothing done) when the fencing token is not
-- current; with w > 0, {acknowledged, one outcome per write: 1 written, 0 skipped, -2 guard
-- failed, {error} refused}.
--#include inbox_store
--#include stream_drop
local fence = KEYS[4] and ARGV[#ARGV] or ''
if fence ~= '' and redis.call('HGET', KEYS[4], 'token') ~= fence then return -1 end  -- fenced: no effect
local n, m, k = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local recs = ARGV[7 + n + m]

-- Acknowledge entries a[ea..eb], record inbox ids b[ba..bb] (their records r), drop the counters.
-- unpack(t, from, to) passes slices without copying them into tables first.
local function settle(a, ea, eb, b, ba, bb, r)
  local acked = 0
  if eb >= ea then
    acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(a, ea, eb))
    if ARGV[2] == '1' then stream_drop(KEYS[1], ARGV[1], a, ea, eb, acked) end
  end
  local count = bb - ba + 1
  if count > 0 then
    inbox_record_all(r, count)
    inbox_flush(KEYS[2])
    if not string.find(r, INBOX_ZERO, 1, true) then  -- every id a UUIDv7/v8 (the common case): no loop
      redis.call('ZREM', KEYS[2], unpack(b, ba, bb))  -- their leases
    else
      local zadd, zrem, now = {}, {}, tonumber(ARGV[3])
      for i = 1, count do
        if string.byte(r, i * 16 - 9) ~= 0 then  -- (byte 7 of record i, the id's version: 0 in a zero record)
          zrem[#zrem + 1] = b[ba + i - 1]
        else
          zadd[#zadd + 1] = now + i / 1024  -- a fraction of a ms apart: distinct scores insert faster than ties
          zadd[#zadd + 1] = b[ba + i - 1]
        end
      end
      if #zrem > 0 then redis.call('ZREM', KEYS[2], unpack(zrem)) end
      if #zadd > 0 then redis.call('ZADD', KEYS[2], unpack(zadd)) end
    end
  end
  if k > 0 then
    redis.call('HDEL', KEYS[3], unpack(ARGV, 8 + n + m, 7 + n + m + k))
  end
  return acked
end

local wpos = 8 + n + m + k
local w = tonumber(ARGV[wpos]) or 0
if w == 0 then
  return settle(ARGV, 7, 6 + n, ARGV, 7 + n, 6 + n + m, recs)
end

-- Guarded writes first (the ids they carry are checked against the inbox in one pass). Flat
-- arrays, not a table per write: tables cost server time per write.
local meta, shapes = ARGV[wpos + 1], tonumber(ARGV[wpos + 2])
local pos = wpos + 3
local fcount, fguard, fnames = {}, {}, {}  -- per shape: p, guard field, ARGV index of its first name
for s = 1, shapes do
  local p = tonumber(ARGV[pos])
  fcount[s], fguard[s], fnames[s] = p, ARGV[pos + 1], pos + 2
  pos = pos + 2 + p
end
local wentry, wmark, wshape, wvalue, subs = {}, {}, {}, {}, {}
for j = 1, w do
  local a, b, c, d, e, f = string.byte(meta, j * 6 - 5, j * 6)
  local mark, shape = c * 256 + d, e * 256 + f
  wentry[j], wmark[j], wshape[j], wvalue[j] = a * 256 + b, mark, shape, pos  -- (its expected value)
  subs[j] = mark > 0 and string.sub(recs, mark * 16 - 15, mark * 16) or INBOX_ZERO
  pos = pos + 1 + fcount[shape]
end
local seen = inbox_seen_many(KEYS[2], table.concat(subs), w)
local outcomes, done, held_entries, held_marks = {}, {}, nil, nil
for j = 1, w do
  local mark, shape, v = wmark[j], wshape[j], wvalue[j]
  local entry = ARGV[6 + wentry[j]]
  local id = mark > 0 and ARGV[6 + n + mark] or nil
  local key = KEYS[4 + j]
  local out
  -- Settled already (a repeated call after a lost reply): nothing again. A fenced call whose write
  -- carries an inbox id needs no XPENDING: in a current tenure only the owner's fenced calls settle
  -- its entries, and a settled run of it recorded that id (the next check finds it).
  if (fence == '' or not id) and #redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1) == 0 then
    out = 0
  elseif id and (seen[j] or done[id] or (string.byte(subs[j], 7) == 0
      and (tonumber(redis.call('ZSCORE', KEYS[2], id)) or -1) >= 0)) then
    out = 0  -- processed before: a duplicate, acknowledged without its write
  else
    local current = redis.pcall('HGET', key, fguard[shape])
    if type(current) == 'table' and current.err then
      out = {current.err}
    elseif (current or '') ~= ARGV[v] then
      out = -2
    else
      local p, f, res = fcount[shape], fnames[shape], nil
      if p == 2 then  -- (the common shapes called directly: no table built)
        res = redis.pcall('HSET', key, ARGV[f], ARGV[v + 1], ARGV[f + 1], ARGV[v + 2])
      elseif p == 3 then
        res = redis.pcall('HSET', key, ARGV[f], ARGV[v + 1], ARGV[f + 1], ARGV[v + 2], ARGV[f + 2], ARGV[v + 3])
      elseif p == 1 then
        res = redis.pcall('HSET', key, ARGV[f], ARGV[v + 1])
      else
        local fv = {}
        for i = 0, p - 1 do
          fv[2 * i + 1], fv[2 * i + 2] = ARGV[f + i], ARGV[v + 1 + i]
        end
        res = redis.pcall('HSET', key, unpack(fv))
      end
      if type(res) == 'table' and res.err then
        out = {res.err}
      else
        out = 1
        if id then done[id] = true end
      end
    end
  end
  if out ~= 1 and out ~= 0 then  -- not written: left pending, neither acknowledged nor recorded
    held_entries = held_entries or {}
    held_entries[wentry[j]] = true
    if mark > 0 then
      held_marks = held_marks or {}
      held_marks[mark] = true
    end
  end
  outcomes[j] = out
end

local acked
if not held_entries then
  acked = settle(ARGV, 7, 6 + n, ARGV, 7 + n, 6 + n + m, recs)
else
  local entries, ids, rs = {}, {}, {}
  for i = 1, n do
    if not held_entries[i] then entries[#entries + 1] = ARGV[6 + i] end
  end
  for i = 1, m do
    if not (held_marks and held_marks[i]) then
      ids[#ids + 1] = ARGV[6 + n + i]
      rs[#rs + 1] = string.sub(recs, i * 16 - 15, i * 16)
    end
  end
  acked = settle(entries, 1, #entries, ids, 1, #ids, table.concat(rs))
end
return {acked, unpack(outcomes)}
