-- inbox_store.lua: the inbox's processed-id buckets, included (not run alone) by ack.lua and
-- commit_effects.lua, which record ids; inbox_claim.lua and intake.lua only look ids up and include
-- inbox_read.lua (included here) alone (see broker/redis/keys.py for the layout and
-- broker/redis/scripts.py for the include).
--
-- A processed UUIDv7/v8 message id is one field of a small hash holding the ids of one short span
-- of id time, kept in the server's compact listpack encoding (13-byte fields, about 64 per hash,
-- under hash-max-listpack-entries = 128):
--
--   <inbox>:info             hash  window = the group's dedup window, ms (set by inbox_claim)
--   <inbox>:<slot>           hash  r = the slot's regimes "T:S,T:S:a,..." (from id time T on, a bucket
--                                  spans 2^S ms; ':a': its buckets are flat), n = ids recorded,
--                                  h / f = highest / lowest id time
--   <inbox>:<slot>:k         set   the slot's buckets, as 'b:<S>:<t >> S>' (to delete without SCAN)
--   <inbox>:b:<S>:<t >> S>   hash  field = id bytes 4..16 (13 bytes), value 1
--   <inbox>:a:<S>:<t >> S>   string  a flat bucket: the same 13-byte fields, one after another
--
-- <slot> is the id's own millisecond time >> 20 (17.5-minute slots) as 7 hex digits. Ids close in
-- time share a bucket, and message ids are time-ordered, so a fetched batch of 500 ids touches a
-- handful of buckets: one HMGET per bucket checks them, one HSET per bucket records them (a few
-- server calls per batch, not per id). S is chosen per slot so a bucket holds about INBOX_FILL ids:
-- from the previous slot's count, else from the spread of the first batch's id times; a bucket
-- that overflows past INBOX_MAX (or stays nearly empty) starts a new regime with a smaller (or
-- larger) S, effective for ids above every id recorded so far (field h), so an id already
-- recorded is always looked up where it was written (a bucket's key names its S).
-- Every write leaves the keys it touched at least the window to live, so whole buckets expire a
-- window (plus a margin) after their last write, with no per-id trimming. The margin M is a
-- quarter of the window, at most INBOX_MARGIN: a bucket with less than the window left (PTTL, a
-- read) gets window + M, the slot's hash and set with less than window + M left get window + 2M
-- (they outlive every bucket of the slot: its regimes say where the buckets' ids are). At a
-- steady rate a key's expiry is written once per M, not on every call (each PEXPIRE is a write
-- the AOF and replicas take). A bucket expires between a window and a window + M after its last
-- write.
-- Finer than a millisecond: once <inbox>:info says fine = 1 (every worker of the group reads such
-- buckets; broker.redis.topology sets it when $FRAMEWORK_INBOX_FINE_BUCKETS is on), S may go down
-- to INBOX_FINE < 0: each ms of id time is split into 2^-S buckets 'b:<S>:<t as hex>.<j>', an id
-- going to the one its j says (the low -S bits of its record's 8th byte: inbox_read.lua's
-- inbox_bucket). A burst (hundreds of ids in one ms) then fills buckets of about INBOX_FILL, not
-- one 1-ms listpack that every HSET scans (its cost grows with the square of the burst).
-- Flat buckets: once <inbox>:info says flat = 1 (every worker of the group reads them; set by the
-- first claim that stores the group's window, inbox_lease.lua, and by the workers started with
-- $FRAMEWORK_INBOX_FLAT_BUCKETS=1: broker.redis.topology), new regimes keep
-- their ids in strings of 13-byte fields, one APPEND per bucket and call: the server does no work
-- per id (an HSET field costs a look-up along the listpack, a value and an argument of its own:
-- callgrind, an ack of 500 ids 23.6k -> 16.8k instructions per id), and an id takes 13 bytes. A
-- lookup GETs the bucket and finds the field in it (at a 13-byte boundary). Ids above every id the
-- slot recorded before (field h) are appended as they come; a bucket that may already hold some
-- of a call's ids (an ack repeated after a lost reply, acks out of id order) is read first, and
-- only the ids it lacks are appended.
-- Only commands of the documented worker ACL are used (HGET, HMGET, HSET, HLEN, GET, APPEND,
-- STRLEN, SADD, PEXPIRE, PTTL, TIME).
--
-- Any other id is kept by its hash (inbox_hashed.lua, included here): its record's 7th byte is 1.
--#include inbox_read
--#include inbox_hashed_record
local INBOX_FILL = 64
local INBOX_MAX = 128
local INBOX_SPARSE = 8
local INBOX_DEFAULT_SHIFT = 8   -- 256 ms buckets until the rate is known
local INBOX_REGIMES = 16        -- at most this many span changes in one slot
local INBOX_DEFAULT_WINDOW = 7 * 24 * 3600 * 1000
local INBOX_MARGIN = 60000     -- ms a key's expiry may run past the window (at most)
local INBOX_FINE = -5          -- the finest regime (32 buckets per ms), once <inbox>:info says fine = 1
local inbox_pt, inbox_pf = {}, {}  -- ids to record (inbox_record_all): their times, their 13-byte fields
local inbox_plo, inbox_phi = 1 / 0, -1  -- the lowest and highest of those times
local inbox_hp = {}  -- hashed records to record (inbox_record_all)

-- (state of one call: a function library's outlives it, so each call starts afresh)
local function inbox_store_begin()
  inbox_pt, inbox_pf, inbox_plo, inbox_phi, inbox_hp = {}, {}, 1 / 0, -1, {}
end

-- The S whose buckets hold about INBOX_FILL ids at this rate, at least min_s (0 unless the group's
-- workers all read regimes finer than a millisecond: inbox_read.lua's inbox_bucket).
local function inbox_shift_for(per_ms, min_s)
  local s, span = 0, INBOX_FILL / per_ms
  while s < 20 and 2 ^ (s + 1) <= span do s = s + 1 end
  while s > min_s and 2 ^ s > span do s = s - 1 end
  return s
end

-- The regime id time t falls in: its shift S and the id time it starts at.
local function inbox_shift(m, t)
  local r = m.r[inbox_regime_at(m, t)]
  return r[2], r[1]
end

-- Queue every id of a string of count 16-byte records (zero records are ignored); inbox_flush
-- writes the queued ids. (inbox_t inlined: every call of a function, Lua's or C's, costs the
-- server more than the arithmetic around it.)
local function inbox_record_all(recs, count)
  local pt, pf = inbox_pt, inbox_pf
  local n = #pt
  local lo, hi = inbox_plo, inbox_phi
  for i = 0, count - 1 do
    local o = i * 16
    local a, b, c, d, e, f, v = string.byte(recs, o + 1, o + 7)
    if v >= 112 then
      local t = ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
      n = n + 1
      pt[n] = t
      pf[n] = string.sub(recs, o + 4, o + 16)
      if t < lo then lo = t end
      if t > hi then hi = t end
    elseif v == INBOX_HASHED then
      inbox_hp[#inbox_hp + 1] = string.sub(recs, o + 1, o + 16)
    end
  end
  inbox_plo, inbox_phi = lo, hi
end

-- Start a regime with shift s (flat buckets or not: the slot's m.flat) for ids above every id
-- recorded so far (m.h): ids already written keep the bucket they were written to (a bucket's key
-- names its span and kind, so old and new never mix). Returns true when the regimes changed: ids
-- grouped by the old ones must be grouped again (a regime dropped for the one before it changes
-- them as much as a new one does).
local function inbox_regime(m, s, old, old_flat)
  if (s == old and m.flat == old_flat) or #m.r >= INBOX_REGIMES then return false end
  local r = m.r
  local t = m.h + 1
  local changed = false
  if r[#r][1] >= t then r[#r] = nil; m.dirty = true; changed = true end  -- a regime no id was recorded in yet
  if r[#r] and r[#r][2] == s and r[#r][3] == m.flat then return changed end
  r[#r + 1] = {t, s, m.flat}
  m.dirty = true
  return true
end

-- The slot's rate so far, ids per ms (from its count and the span of its ids' times)
local function inbox_slot_rate(m, extra, lo, hi)
  local f = math.min(m.f or lo, lo)
  return (m.n + extra) / (math.max(m.h, hi) - f + 1)
end

-- A bucket of this call's grouping (key, shift s, first id time t, flat or a hash), listed in order.
local function inbox_new_bucket(buckets, border, key, s, t, flat)
  local b = {key = key, args = {}, c = 0, s = s, lo = t, t = t, flat = flat}
  buckets[key] = b
  border[#border + 1] = b
  return b
end

-- Record the queued ids: per slot, its info; per bucket, one HSET (ids a bucket already holds are
-- no-ops), an HLEN when something was added, its expiry set to the window.
local function inbox_flush(base)
  if #inbox_hp > 0 then
    local hp = inbox_hp
    inbox_hp = {}
    inbox_hrecord(base, hp)
  end
  local pt, pf = inbox_pt, inbox_pf
  if #pt == 0 then return end
  local plo, phi = inbox_plo, inbox_phi
  inbox_pt, inbox_pf, inbox_plo, inbox_phi = {}, {}, math.huge, -1
  local info = redis.call('HMGET', base .. ':info', 'window', 'fine', 'flat')
  local window = tonumber(info[1]) or INBOX_DEFAULT_WINDOW
  local min_s = info[2] == '1' and INBOX_FINE or 0
  local flat = info[3] == '1'
  local margin = math.min(INBOX_MARGIN, math.floor(window / 4))
  local slots, sorder = {}, {}
  local slo, shi, g = 0, -1, nil  -- the span of the previous id's slot, and its group
  local ungrouped = #pt
  if math.floor(plo / INBOX_SLOT) == math.floor(phi / INBOX_SLOT) then  -- one slot (the common case)
    local slot = math.floor(plo / INBOX_SLOT)
    slots[slot] = {fs = pf, ts = pt, n = #pt, lo = plo, hi = phi}
    sorder[1] = slot
    ungrouped = 0
  end
  for i = 1, ungrouped do
    local t = pt[i]
    if t < slo or t >= shi then
      local slot = math.floor(t / INBOX_SLOT)
      slo, shi = slot * INBOX_SLOT, (slot + 1) * INBOX_SLOT
      g = slots[slot]
      if not g then
        g = {fs = {}, ts = {}, n = 0, lo = t, hi = t}
        slots[slot] = g
        sorder[#sorder + 1] = slot
      end
    end
    local n = g.n + 1
    g.n = n
    g.fs[n] = pf[i]
    g.ts[n] = t
    if t < g.lo then g.lo = t elseif t > g.hi then g.hi = t end
  end
  for _, slot in ipairs(sorder) do
    g = slots[slot]
    local m = inbox_meta(base, slot)
    if not m then  -- the slot's first record: choose its buckets' span
      local rate = 0  -- ids per ms: the previous slot's, or this call's if higher
      local prev = tonumber(redis.call('HGET', base .. ':' .. string.format('%07x', slot - 1), 'n'))
      if prev then rate = prev / INBOX_SLOT end
      if g.n >= 16 then rate = math.max(rate, g.n / (g.hi - g.lo + 1)) end
      local s = INBOX_DEFAULT_SHIFT
      if rate > 0 then s = inbox_shift_for(rate, min_s) end
      m = {key = base .. ':' .. string.format('%07x', slot), r = {{0, s, flat}}, n = 0, h = 0, f = g.lo, dirty = true}
      inbox_metas[slot] = m
    end
    m.flat = flat  -- the kind of bucket new regimes get
    local last = m.r[#m.r]
    if last[3] ~= flat then inbox_regime(m, last[2], last[2], last[3]) end  -- (flat turned on or off)
    -- Group the ids by bucket; a bucket this call alone would overflow starts a regime of smaller
    -- buckets above every id recorded before (m.h), and the ids are grouped again.
    local buckets, border
    local ts, fs = g.ts, g.fs
    local runs = 0  -- runs of ids of one ms: g.n / runs is this call's ids per ms they fall in
    for attempt = 1, 5 do  -- (the fifth grouping is final: it uses the regimes that are kept)
      buckets, border = {}, {}
      local prev_t = -1
      runs = 0
      local lo, hi, b = 0, -1, nil  -- the span of the previous id's bucket, and the bucket
      -- In a regime finer than a ms (S < 0), the ids of one ms spread over 2^-S buckets by their j
      -- (the low bits of the record's 8th byte, a field's 5th): that ms's buckets by j.
      local fine, bsub, jt, prefix, bs, pflat = false, 1, nil, nil, 0, false
      for i = 1, g.n do
        local t = ts[i]
        if t ~= prev_t then runs = runs + 1; prev_t = t end
        if t < lo or t >= hi then
          local key, bflat
          local sub = string.byte(fs[i], 5)
          key, bs, lo, hi, bflat = inbox_bucket(base, m, t, sub)
          fine = bs < 0
          b = buckets[key] or inbox_new_bucket(buckets, border, key, bs, t, bflat)
          if fine then
            bsub, jt, prefix, pflat = 2 ^ -bs, {}, inbox_fine_prefix(base, bs, t, bflat), bflat
            jt[sub % bsub] = b
          end
        elseif fine then
          local j = string.byte(fs[i], 5) % bsub
          b = jt[j]
          if not b then
            local key = prefix .. j
            b = buckets[key] or inbox_new_bucket(buckets, border, key, bs, t, pflat)
            jt[j] = b
          end
        end
        local c = b.c + 1  -- ids in b; b.args: their fields (flat), or field and value pairs (a hash)
        b.c = c
        if b.flat then
          b.args[c] = fs[i]
        else
          b.args[2 * c - 1] = fs[i]
          b.args[2 * c] = '1'
        end
        if t > b.t then b.t = t elseif t < b.lo then b.lo = t end
      end
      local split = false
      for _, b in ipairs(border) do
        local count = b.c
        if attempt < 5 and count > INBOX_MAX and b.s > min_s then
          local rate = math.max(count / 2 ^ b.s, count / (b.t - b.lo + 1))
          if inbox_regime(m, inbox_shift_for(rate, min_s), b.s, b.flat) then split = true; break end
        end
      end
      if not split then break end
    end
    local h0 = m.h  -- ids above it were never recorded in this slot
    if g.hi > m.h then m.h = g.hi end  -- regimes started below are above every id of this call
    local added_all = 0
    for _, b in ipairs(border) do
      local key = b.key
      local added, len = 0, 0
      if b.flat then
        local fields = b.args
        if b.lo <= h0 then  -- some may be recorded already (an ack repeated): append only the others
          local have = redis.call('GET', key) or ''
          local seen, keep = {}, {}
          for j = 1, b.c do
            local f = fields[j]
            if not seen[f] and not inbox_flat_has(have, f) then keep[#keep + 1] = f end
            seen[f] = true
          end
          fields = keep
        end
        added = #fields
        if added > 0 then
          len = redis.call('APPEND', key, table.concat(fields)) / 13
        end
      else
        for from = 1, 2 * b.c, 2000 do
          added = added + redis.call('HSET', key, unpack(b.args, from, math.min(from + 1999, 2 * b.c)))
        end
      end
      if redis.call('PTTL', key) < window then redis.call('PEXPIRE', key, window + margin) end
      if added > 0 then
        added_all = added_all + added
        if not b.flat then len = redis.call('HLEN', key) end
        if len == added then  -- new
          redis.call('SADD', m.key .. ':k', string.sub(key, #base + 2))
          m.grew = true
        end
        if len > INBOX_MAX and b.s > min_s then
          local rate = math.max(len / 2 ^ b.s, inbox_slot_rate(m, added_all, g.lo, g.hi))
          inbox_regime(m, inbox_shift_for(rate, min_s), b.s, b.flat)
        elseif len == added and len < INBOX_SPARSE and b.s < 0 then
          -- A new, nearly empty bucket finer than a ms: coarser again if this call's ids came
          -- fewer per ms than the regime assumed, counted over the ms they fall in (not the
          -- slot's rate, nor the span of the call's ids: a backlog made in bursts of a few ms,
          -- sent over seconds, averages far below the density of its bursts)
          local s = inbox_shift_for(g.n / math.max(runs, 1), min_s)
          if s > b.s then inbox_regime(m, s, b.s, b.flat) end
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
            local prev = base .. (b.flat and ':a:' or ':b:') .. b.s .. ':' .. string.format('%x', k)
            plen = b.flat and redis.call('STRLEN', prev) / 13 or redis.call('HLEN', prev)
          end
          if plen < INBOX_SPARSE then
            local s = inbox_shift_for(inbox_slot_rate(m, added_all, g.lo, g.hi), min_s)
            if s > b.s then inbox_regime(m, s, b.s, b.flat) end
          end
        end
      end
    end
    m.n = m.n + added_all
    if m.dirty then
      local parts = {}
      for i, r in ipairs(m.r) do parts[i] = string.format(r[3] and '%d:%d:a' or '%d:%d', r[1], r[2]) end
      if not m.f or g.lo < m.f then m.f = g.lo end
      redis.call('HSET', m.key, 'r', table.concat(parts, ','), 'n', m.n, 'h', string.format('%d', m.h),
        'f', string.format('%d', m.f))
      m.dirty = false
    elseif added_all > 0 then
      if not m.f or g.lo < m.f then
        m.f = g.lo
        redis.call('HSET', m.key, 'n', m.n, 'h', string.format('%d', m.h), 'f', string.format('%d', m.f))
      else
        redis.call('HSET', m.key, 'n', m.n, 'h', string.format('%d', m.h))
      end
    end
    -- (a slot that grew a bucket this call refreshes too: its set of buckets may be new)
    if m.grew or redis.call('PTTL', m.key) < window + margin then
      redis.call('PEXPIRE', m.key, window + 2 * margin)
      redis.call('PEXPIRE', m.key .. ':k', window + 2 * margin)
      m.grew = false
    end
  end
end
