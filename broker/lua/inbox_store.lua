-- inbox_store.lua: the inbox's processed-id buckets, included (not run alone) by inbox_claim.lua,
-- ack.lua and commit_effects.lua (see broker/keys.py for the layout and broker/scripts.py for
-- the include).
--
-- A processed UUIDv7/v8 message id is one field of a small hash holding the ids of one short span
-- of id time, kept in the server's compact listpack encoding (13-byte fields, about 64 per hash,
-- under hash-max-listpack-entries = 128):
--
--   <inbox>:info             hash  window = the group's dedup window, ms (set by inbox_claim)
--   <inbox>:<slot>           hash  r = the slot's regimes "T:S,T:S,..." (from id time T on, a bucket
--                                  spans 2^S ms), n = ids recorded, h / f = highest / lowest id time
--   <inbox>:<slot>:k         set   the slot's buckets, as 'b:<S>:<t >> S>' (to delete without SCAN)
--   <inbox>:b:<S>:<t >> S>   hash  field = id bytes 4..16 (13 bytes), value 1
--
-- <slot> is the id's own millisecond time >> 20 (17.5-minute slots) as 7 hex digits. Ids close in
-- time share a bucket, and message ids are time-ordered, so a fetched batch of 500 ids touches a
-- handful of buckets: one HMGET per bucket checks them, one HSET per bucket records them (a few
-- server calls per batch, not per id). S is chosen per slot so a bucket holds about INBOX_FILL ids:
-- from the previous slot's count, else from the spread of the first batch's id times; a bucket
-- that overflows past INBOX_MAX (or stays nearly empty) starts a new regime with a smaller (or
-- larger) S, effective for ids above every id recorded so far (field h), so an id already
-- recorded is always looked up where it was written (a bucket's key names its S).
-- Every write sets the expiry of the keys it touched to the window from now: whole buckets expire
-- a window after their last write, with no per-id trimming.
-- Only commands of the documented worker ACL are used (HGET, HMGET, HSET, HLEN, SADD, PEXPIRE).
local INBOX_FILL = 64
local INBOX_MAX = 128
local INBOX_SPARSE = 8
local INBOX_DEFAULT_SHIFT = 8   -- 256 ms buckets until the rate is known
local INBOX_SLOT = 1048576      -- 2^20 ms
local INBOX_REGIMES = 16        -- at most this many span changes in one slot
local INBOX_DEFAULT_WINDOW = 7 * 24 * 3600 * 1000

local inbox_metas = {}    -- slot number -> {key, r = {{t, s}, ...}, n, h, dirty} or false
local inbox_pending = {}  -- 16-byte ids to record (inbox_record), written by inbox_flush

-- The scripts take each id's 16-byte form from the caller (broker.keys.compact_id: '' for ids that are
-- not UUIDv7/v8, kept in the zset): deriving it in Lua costs several microseconds of server time per id.

local function inbox_time(bin)  -- the id's 48-bit Unix ms (exact in a Lua number)
  local a, b, c, d, e, f = string.byte(bin, 1, 6)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end

local function inbox_shift_for(per_ms)  -- the S whose buckets hold about INBOX_FILL ids at this rate
  local s, span = 0, INBOX_FILL / per_ms
  while s < 20 and 2 ^ (s + 1) <= span do s = s + 1 end
  return s
end

local function inbox_meta(base, slot)
  local m = inbox_metas[slot]
  if m == nil then
    local key = base .. ':' .. string.format('%07x', slot)
    local v = redis.call('HMGET', key, 'r', 'n', 'h', 'f')
    if v[1] then
      local r = {}
      for t, s in string.gmatch(v[1], '(%d+):(%d+)') do r[#r + 1] = {tonumber(t), tonumber(s)} end
      m = {key = key, r = r, n = tonumber(v[2]) or 0, h = tonumber(v[3]) or 0, f = tonumber(v[4])}
    else
      m = false
    end
    inbox_metas[slot] = m
  end
  return m
end

-- The regime id time t falls in: its shift S and the id time it starts at.
local function inbox_shift(m, t)
  local r = m.r
  local i = 1
  while r[i + 1] and r[i + 1][1] <= t do i = i + 1 end
  return r[i][2], r[i][1]
end

local INBOX_POW = {}  -- 2^S, S = 0..20
for i = 0, 20 do INBOX_POW[i] = 2 ^ i end

-- The group of bucket (s, t) in groups[s][k] (k = t >> s), made with make() the first time and
-- appended to order; the bucket's key is formatted once per group, not once per id.
local function inbox_group(groups, order, base, s, t, make)
  local k = math.floor(t / INBOX_POW[s])
  local gs = groups[s]
  if not gs then
    gs = {}
    groups[s] = gs
  end
  local g = gs[k]
  if not g then
    g = make(s, t)
    g.key = base .. ':b:' .. s .. ':' .. string.format('%x', k)
    gs[k] = g
    order[#order + 1] = g
  end
  return g
end

local function inbox_new_lookup() return {fields = {}, idx = {}} end
local function inbox_new_bucket(s, t) return {args = {}, s = s, lo = t, t = t} end

-- Which of the ids are recorded as processed. bins[first .. first+count-1] are 16-byte ids ('' for
-- ids kept in the zset, reported false); returns a table of booleans 1..count. One HMGET of the
-- slot's info and one HMGET per bucket touched.
local function inbox_seen_many(base, bins, first, count)
  local seen, groups, order = {}, {}, {}
  for i = 1, count do
    seen[i] = false
    local bin = bins[first + i - 1]
    if bin ~= '' then
      local t = inbox_time(bin)
      local m = inbox_meta(base, math.floor(t / INBOX_SLOT))
      if m then
        local g = inbox_group(groups, order, base, (inbox_shift(m, t)), t, inbox_new_lookup)
        g.fields[#g.fields + 1] = string.sub(bin, 4)
        g.idx[#g.idx + 1] = i
      end
    end
  end
  for _, g in ipairs(order) do
    for from = 1, #g.fields, 1000 do
      local to = math.min(from + 999, #g.fields)
      local got = redis.call('HMGET', g.key, unpack(g.fields, from, to))
      for j = 1, #got do
        if got[j] then seen[g.idx[from + j - 1]] = true end
      end
    end
  end
  return seen
end

local function inbox_seen(base, bin)
  return inbox_seen_many(base, {bin}, 1, 1)[1]
end

-- Queue a 16-byte id to record as processed; inbox_flush writes the queued ids.
local function inbox_record(base, bin)
  inbox_pending[#inbox_pending + 1] = bin
end

-- Start a regime with shift s for ids above every id recorded so far (m.h): ids already written
-- keep the span they were written with (a bucket's key names its span, so old and new never mix).
local function inbox_regime(m, s, old)
  if s == old or #m.r >= INBOX_REGIMES then return end
  local r = m.r
  local t = m.h + 1
  if r[#r][1] >= t then r[#r] = nil; m.dirty = true end  -- a regime no id was recorded in yet
  if r[#r] and r[#r][2] == s then return end
  r[#r + 1] = {t, s}
  m.dirty = true
end

-- The slot's rate so far, ids per ms (from its count and the span of its ids' times)
local function inbox_slot_rate(m, extra, lo, hi)
  local f = math.min(m.f or lo, lo)
  return (m.n + extra) / (math.max(m.h, hi) - f + 1)
end

-- Record the queued ids: per slot, its info; per bucket, one HSET (ids a bucket already holds are
-- no-ops), an HLEN when something was added, its expiry set to the window.
local function inbox_flush(base)
  if #inbox_pending == 0 then return end
  local window = tonumber(redis.call('HGET', base .. ':info', 'window')) or INBOX_DEFAULT_WINDOW
  local slots, sorder = {}, {}
  for _, bin in ipairs(inbox_pending) do
    local t = inbox_time(bin)
    local slot = math.floor(t / INBOX_SLOT)
    local g = slots[slot]
    if not g then
      g = {bins = {}, ts = {}, lo = t, hi = t}
      slots[slot] = g
      sorder[#sorder + 1] = slot
    end
    g.bins[#g.bins + 1] = bin
    g.ts[#g.ts + 1] = t
    if t < g.lo then g.lo = t end
    if t > g.hi then g.hi = t end
  end
  inbox_pending = {}
  for _, slot in ipairs(sorder) do
    local g = slots[slot]
    local m = inbox_meta(base, slot)
    if not m then  -- the slot's first record: choose its buckets' span
      local rate = 0  -- ids per ms: the previous slot's, or this call's if higher
      local prev = tonumber(redis.call('HGET', base .. ':' .. string.format('%07x', slot - 1), 'n'))
      if prev then rate = prev / INBOX_SLOT end
      if #g.ts >= 16 then rate = math.max(rate, #g.ts / (g.hi - g.lo + 1)) end
      local s = INBOX_DEFAULT_SHIFT
      if rate > 0 then s = inbox_shift_for(rate) end
      m = {key = base .. ':' .. string.format('%07x', slot), r = {{0, s}}, n = 0, h = 0, f = g.lo, dirty = true}
      inbox_metas[slot] = m
    end
    -- Group the ids by bucket; a bucket this call alone would overflow starts a regime of smaller
    -- buckets above every id recorded before (m.h), and the ids are grouped again.
    local buckets, border
    for _ = 1, 4 do
      buckets, border = {}, {}
      for i = 1, #g.bins do
        local t = g.ts[i]
        local b = inbox_group(buckets, border, base, (inbox_shift(m, t)), t, inbox_new_bucket)
        b.args[#b.args + 1] = string.sub(g.bins[i], 4)
        b.args[#b.args + 1] = 1
        if t > b.t then b.t = t end
        if t < b.lo then b.lo = t end
      end
      local split = false
      for _, b in ipairs(border) do
        local count = #b.args / 2
        if count > INBOX_MAX and b.s > 0 then
          local before = #m.r
          local rate = math.max(count / 2 ^ b.s, count / (b.t - b.lo + 1))
          inbox_regime(m, inbox_shift_for(rate), b.s)
          if #m.r > before then split = true; break end
        end
      end
      if not split then break end
    end
    if g.hi > m.h then m.h = g.hi end  -- regimes started below are above every id of this call
    local added_all = 0
    for _, b in ipairs(border) do
      local key = b.key
      local added = 0
      for from = 1, #b.args, 2000 do
        added = added + redis.call('HSET', key, unpack(b.args, from, math.min(from + 1999, #b.args)))
      end
      redis.call('PEXPIRE', key, window)
      if added > 0 then
        added_all = added_all + added
        local len = redis.call('HLEN', key)
        if len == added then redis.call('SADD', m.key .. ':k', string.sub(key, #base + 2)) end  -- new
        if len > INBOX_MAX and b.s > 0 then
          inbox_regime(m, inbox_shift_for(math.max(len / 2 ^ b.s, inbox_slot_rate(m, added_all, g.lo, g.hi))), b.s)
        elseif len == added and len < INBOX_SPARSE and b.s < 20 then
          -- a new, nearly empty bucket: if the one before it also stayed nearly empty, the rate
          -- is lower than the span assumed. The new span comes from the slot's rate so far, not
          -- from that bucket's count: acks arrive out of id order (several workers, handlers of
          -- different lengths), so the bucket before may still be filling, and a span sized from
          -- it overshoots into buckets past INBOX_MAX (hashtable-encoded: twice the bytes per id)
          local unit = 2 ^ b.s
          local k = math.floor(b.t / unit) - 1
          local plen = INBOX_SPARSE
          if k * unit >= select(2, inbox_shift(m, b.t)) then  -- the bucket before, in the same regime
            plen = redis.call('HLEN', base .. ':b:' .. b.s .. ':' .. string.format('%x', k))
          end
          if plen < INBOX_SPARSE then
            local s = inbox_shift_for(inbox_slot_rate(m, added_all, g.lo, g.hi))
            if s > b.s then inbox_regime(m, s, b.s) end
          end
        end
      end
    end
    if added_all > 0 or m.dirty then
      m.n = m.n + added_all
      local parts = {}
      for i, r in ipairs(m.r) do parts[i] = string.format('%d:%d', r[1], r[2]) end
      if not m.f or g.lo < m.f then m.f = g.lo end
      redis.call('HSET', m.key, 'r', table.concat(parts, ','), 'n', m.n, 'h', string.format('%d', m.h),
        'f', string.format('%d', m.f))
      m.dirty = false
    end
    redis.call('PEXPIRE', m.key, window)
    redis.call('PEXPIRE', m.key .. ':k', window)
  end
end
