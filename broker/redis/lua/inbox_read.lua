-- inbox_read.lua: looking ids up in the inbox's processed-id buckets (inbox_store.lua has the
-- layout); included by inbox_store.lua (which records), and alone by the scripts that only
-- check and lease (inbox_claim.lua, intake.lua). Under EVALSHA every function a script includes
-- is built anew on each call (a closure and its tables: on Valkey 9.1 about 16 us for the whole
-- library); as a server function once, when its library loads (broker/redis/scripts.py), so state
-- kept for one call is reset by a <file>_begin() the function calls first.
--#include inbox_hashed
local INBOX_SLOT = 1048576      -- 2^20 ms

local inbox_metas = {}    -- slot number -> {key, r = {{t, s}, ...}, n, h, dirty} or false

-- (state of one call: a function library's outlives it, so each call starts afresh)
local function inbox_read_begin() inbox_metas = {} end

-- The scripts take the ids' 16-byte forms from the caller as one string of 16-byte records
-- (broker.redis.keys.inbox_records: 16 zero bytes for ids that are not UUIDv7/v8, kept in the zset):
-- deriving them in Lua, or taking one argument per id, costs microseconds of server time per id.
-- The loops below do per id only what cannot be done per bucket: its time, two comparisons with
-- the span of the bucket the ids before it fell in (ids are time-ordered: runs share a bucket),
-- and its 13-byte field.

-- the record of an id that is not UUIDv7/v8 (see inbox_t); a literal: a function library's top
-- level cannot reach the string library (broker/redis/scripts.py)
local INBOX_ZERO = '\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0'

-- The id time (48-bit Unix ms, exact in a Lua number) of the record at offset o (0-based) of a
-- string of 16-byte records, or nil for a zero record (from an older client: an id that is not
-- UUIDv7/v8, kept in the zset) or a hashed record: their 7th byte is 0 or 1, a UUID's version
-- byte 0x7? or 0x8?.
local function inbox_t(recs, o)
  local a, b, c, d, e, f, v = string.byte(recs, o + 1, o + 7)
  if v < 112 then return nil end
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end

local function inbox_meta(base, slot)
  local m = inbox_metas[slot]
  if m == nil then
    local key = base .. ':' .. string.format('%07x', slot)
    local v = redis.call('HMGET', key, 'r', 'n', 'h', 'f')
    if v[1] then
      local r = {}
      for t, s, a in string.gmatch(v[1], '(%d+):(%-?%d+)(:?a?)') do r[#r + 1] = {tonumber(t), tonumber(s), a == ':a'} end
      m = {key = key, r = r, n = tonumber(v[2]) or 0, h = tonumber(v[3]) or 0, f = tonumber(v[4])}
    else
      m = false
    end
    inbox_metas[slot] = m
  end
  return m
end

-- The index in m.r of the regime id time t falls in.
local function inbox_regime_at(m, t)
  local r = m.r
  local i = 1
  while r[i + 1] and r[i + 1][1] <= t do i = i + 1 end
  return i
end

-- The bucket of id time t under the slot's regimes: its key, its shift S, the span [lo, hi) of
-- id times that fall in it (the bucket's own span cut by the regimes' bounds), and whether it is
-- flat. A regime with S < 0 splits each millisecond into 2^-S buckets, '<b|a>:<S>:<t as hex>.<j>',
-- an id going to the one its j says: the low -S bits of sub, the 8th byte of its record (the low
-- byte of the UUID's rand_a); such a bucket's span is its millisecond, and it holds only the ids
-- of that j. A regime written 'T:S:a' keeps its ids in flat buckets, 'a:<S>:...': a string of
-- 13-byte fields, appended to (inbox_store.lua), where 'b:' buckets are hashes. Writers start
-- finer or flat regimes only once <inbox>:info says fine = 1 or flat = 1: workers of earlier
-- releases cannot read them.
local function inbox_fine_prefix(base, s, t, flat)  -- the key of a bucket of millisecond t, but its j
  return base .. (flat and ':a:' or ':b:') .. s .. ':' .. string.format('%x', t) .. '.'
end

local function inbox_bucket(base, m, t, sub)
  local r = m.r
  local i = inbox_regime_at(m, t)
  local s, flat = r[i][2], r[i][3]
  if s < 0 then
    return inbox_fine_prefix(base, s, t, flat) .. (sub % 2 ^ -s), s, t, t + 1, flat
  end
  local unit = 2 ^ s
  local k = math.floor(t / unit)
  local lo, hi = k * unit, (k + 1) * unit
  if r[i][1] > lo then lo = r[i][1] end
  if r[i + 1] and r[i + 1][1] < hi then hi = r[i + 1][1] end
  return base .. (flat and ':a:' or ':b:') .. s .. ':' .. string.format('%x', k), s, lo, hi, flat
end

-- Whether the flat bucket string b holds the 13-byte field f (at a field's boundary: a match that
-- straddles two fields is not one).
local function inbox_flat_has(b, f)
  local p = string.find(b, f, 1, true)
  while p do
    if (p - 1) % 13 == 0 then return true end
    p = string.find(b, f, p + 1, true)
  end
  return false
end

-- Which of the count ids whose records recs holds are recorded as processed: a table of booleans
-- 1..count (false for zero records). One HMGET of the info of each slot touched and one HMGET
-- (a flat bucket: one GET) per bucket. lo, hi (optional): the lowest and highest id time of the
-- records, given only when every record is a UUIDv7/v8's; when both fall in one slot whose ids
-- recorded are all older than lo (its field h), none is recorded and the records are not read
-- one by one.
local function inbox_seen_many(base, recs, count, lo_t, hi_t)
  if lo_t and math.floor(lo_t / INBOX_SLOT) == math.floor(hi_t / INBOX_SLOT) then
    -- (only the slot's h, not its regimes: inbox_meta's read and parse cost the server about 4x
    -- an HGET, and a queue read in order, a message or a batch at a time, stops here)
    local slot = math.floor(lo_t / INBOX_SLOT)
    local m = inbox_metas[slot]
    local h = m and m.h
    if m == nil then h = tonumber(redis.call('HGET', base .. ':' .. string.format('%07x', slot), 'h')) end
    if not h or h < lo_t then return {} end  -- (nil for every index: not recorded)
  end
  local seen, order, groups = {}, {}, {}
  local hidx, hrecs = {}, {}  -- hashed records
  local lo, hi, g = 0, -1, nil  -- the span the previous id's bucket covers (g false: no records there)
  local top = -1  -- the highest id time recorded in that bucket's slot (its field h)
  local fine, sub, bsub, lo_sub = false, 0, 1, 0  -- that bucket splits its ms (S < 0); its j
  for i = 1, count do
    seen[i] = false
    local o = (i - 1) * 16
    local t = inbox_t(recs, o)
    if not t and string.byte(recs, o + 7) == INBOX_HASHED then
      hidx[#hidx + 1] = i
      hrecs[#hrecs + 1] = string.sub(recs, o + 1, o + 16)
    elseif t then
      if fine then sub = string.byte(recs, o + 8) end
      if t < lo or t >= hi or (fine and sub % bsub ~= lo_sub) then
        local slot = math.floor(t / INBOX_SLOT)
        local m = inbox_meta(base, slot)
        if m then
          local key, s, flat
          if not fine then sub = string.byte(recs, o + 8) end  -- (read above when it was)
          key, s, lo, hi, flat = inbox_bucket(base, m, t, sub)
          fine = s < 0
          if fine then bsub = 2 ^ -s; lo_sub = sub % bsub end
          top = m.h
          g = groups[key]
          if not g then
            g = {key = key, fields = {}, idx = {}, n = 0, flat = flat}
            groups[key] = g
            order[#order + 1] = g
          end
        else  -- a slot nothing was recorded in
          g = false
          fine = false
          lo, hi = slot * INBOX_SLOT, (slot + 1) * INBOX_SLOT
        end
      end
      -- Every record of a slot writes its h (inbox_flush): an id above it was never recorded, so
      -- the ids of a fetch newer than everything processed (a queue read in order) cost no lookup.
      if g and t <= top then
        local n = g.n + 1
        g.n = n
        g.fields[n] = string.sub(recs, o + 4, o + 16)
        g.idx[n] = i
      end
    end
  end
  for _, grp in ipairs(order) do
    if grp.flat then
      local b = grp.n > 0 and redis.call('GET', grp.key)
      if b then
        for j = 1, grp.n do
          if inbox_flat_has(b, grp.fields[j]) then seen[grp.idx[j]] = true end
        end
      end
    else
      for from = 1, grp.n, 1000 do
        local to = math.min(from + 999, grp.n)
        local got = redis.call('HMGET', grp.key, unpack(grp.fields, from, to))
        for j = 1, #got do
          if got[j] then seen[grp.idx[from + j - 1]] = true end
        end
      end
    end
  end
  if #hidx > 0 then inbox_hseen(base, hidx, hrecs, seen) end
  return seen
end

