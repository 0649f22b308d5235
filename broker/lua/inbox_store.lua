-- inbox_store.lua: the inbox's processed-id buckets, included (not run alone) by inbox_claim.lua,
-- ack.lua and commit_effects.lua (see broker/keys.py for the layout and broker/scripts.py for
-- the include).
--
-- A processed UUIDv7/v8 message id is one entry of a small hash, kept in the server's compact
-- listpack encoding (13-byte fields, about 40 per hash, far under hash-max-listpack-entries = 128):
--
--   <inbox>:info            hash  window = the group's dedup window, ms (set by inbox_claim)
--   <inbox>:<slot>          hash  w = the slot's buckets, n = ids recorded in them
--   <inbox>:<slot>:<index>  hash  field = id bytes 4..16 (13 bytes), value 1
--
-- <slot> is the id's own millisecond time >> 20 (17.5-minute slots) as 7 hex digits: the id's
-- first 7 hex digits. The buckets of a slot grow by linear hashing: with w buckets, 2^i <= w <
-- 2^(i+1), an id with h = its last 4 (random) bytes lies in bucket h % 2^(i+1), or h % 2^i when
-- that is w or more; when the slot averages more than INBOX_LOAD ids per bucket, bucket w - 2^i is
-- split into itself and a new bucket w. So a lookup is one HGET, whatever the rate, and a bucket
-- holds about 20 to 80 ids. w starts from the previous slot's count (fewer splits at a steady rate).
-- Every write sets the expiry of the keys it touched (and of the slot's info) to the window from
-- now, so whole buckets expire a window after their last write (PEXPIRE): no per-id trimming.
-- Only commands of the documented worker ACL are used (HGET, HGETALL, HSET, HDEL, HINCRBY, PEXPIRE).
local INBOX_LOAD = 40
local INBOX_DEFAULT_WINDOW = 7 * 24 * 3600 * 1000

local inbox_states = {}   -- slot -> {w, n, added} (false: the slot has no record), read once per call
local inbox_dirty = {}    -- bucket keys this call wrote (their expiry is set by inbox_flush)

-- The 16-byte form of a UUID text id of version 7 or 8, '' for any other id (kept in the zset).
-- Callers on the hot path pass it from Python (broker.keys.compact_id: the same rule).
local function inbox_compact(id)
  if #id ~= 36 or not string.find(string.sub(id, 15, 15), '^[78]$') then return '' end
  local hex = string.gsub(id, '-', '')
  if #hex ~= 32 or string.find(hex, '[^0-9a-fA-F]') then return '' end
  return (string.gsub(hex, '..', function(h) return string.char(tonumber(h, 16)) end))
end

local inbox_slots = {}     -- the id's first 4 bytes -> its slot name (ids of one batch share a few)

local function inbox_slot(bin)
  local head = string.sub(bin, 1, 4)
  local slot = inbox_slots[head]
  if not slot then
    local b1, b2, b3, b4 = string.byte(head, 1, 4)
    slot = string.format('%02x%02x%02x%x', b1, b2, b3, math.floor(b4 / 16))
    inbox_slots[head] = slot
  end
  return slot
end

-- h of a stored field (id bytes 4..16): the id's last 4 bytes are the field's bytes 10..13
local function inbox_hash(field)
  local a, b, c, d = string.byte(field, 10, 13)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

local function inbox_bucket(h, w)  -- a number below 2^31: '..' writes it as an integer
  local size = 1
  while size * 2 <= w do size = size * 2 end
  local b = h % (size * 2)
  if b >= w then b = h % size end
  return b
end

local function inbox_state(base, slot)
  local st = inbox_states[slot]
  if st == nil then
    local meta = base .. ':' .. slot
    local w = tonumber(redis.call('HGET', meta, 'w'))
    st = w and {w = w, n = tonumber(redis.call('HGET', meta, 'n')) or 0, added = 0, prefix = meta .. ':'} or false
    inbox_states[slot] = st
  end
  return st
end

-- Whether the id (16 bytes) is recorded as processed: one HGET.
local function inbox_seen(base, bin)
  local slot = inbox_slot(bin)
  local st = inbox_state(base, slot)
  if not st then return false end
  local field = string.sub(bin, 4)
  return redis.call('HGET', st.prefix .. inbox_bucket(inbox_hash(field), st.w), field) ~= false
end

-- Add bucket w to the slot: the ids of bucket w - 2^i that now belong to it move there.
local function inbox_split(prefix, st)
  local w = st.w
  local size = 1
  while size * 2 <= w do size = size * 2 end
  local from, to = prefix .. (w - size), prefix .. w
  local flat = redis.call('HGETALL', from)
  local moved, pairs_ = {}, {}
  for j = 1, #flat, 2 do
    local f = flat[j]
    if inbox_hash(f) % (size * 2) == w then
      moved[#moved + 1] = f
      pairs_[#pairs_ + 1] = f
      pairs_[#pairs_ + 1] = 1
    end
  end
  if #moved > 0 then
    redis.call('HSET', to, unpack(pairs_))
    redis.call('HDEL', from, unpack(moved))
    inbox_dirty[to] = true
  end
  st.w = w + 1
end

-- Record the id (16 bytes) as processed (a no-op when it is); inbox_flush sets the expiries.
local function inbox_record(base, bin)
  local slot = inbox_slot(bin)
  local st = inbox_state(base, slot)
  if not st then  -- the slot's first record: as many buckets as the previous slot ended with
    local prev = redis.call('HGET', base .. ':' .. string.format('%07x', tonumber(slot, 16) - 1), 'n')
    st = {w = math.max(1, math.ceil((tonumber(prev) or 0) / INBOX_LOAD)), n = 0, added = 0,
          prefix = base .. ':' .. slot .. ':'}
    inbox_states[slot] = st
  end
  local field = string.sub(bin, 4)
  local prefix = st.prefix
  local key = prefix .. inbox_bucket(inbox_hash(field), st.w)
  inbox_dirty[key], st.touched = true, true
  if redis.call('HSET', key, field, 1) == 1 then
    st.n, st.added = st.n + 1, st.added + 1
    while st.n > INBOX_LOAD * st.w do inbox_split(prefix, st) end
  end
end

-- Store the slots' bucket counts and set the expiry of everything written to the group's window.
local function inbox_flush(base)
  local window = tonumber(redis.call('HGET', base .. ':info', 'window')) or INBOX_DEFAULT_WINDOW
  for key in pairs(inbox_dirty) do redis.call('PEXPIRE', key, window) end
  for slot, st in pairs(inbox_states) do
    if st and st.touched then  -- the slot's info lives as long as any of its buckets
      local meta = base .. ':' .. slot
      if st.added > 0 then
        redis.call('HSET', meta, 'w', st.w)
        redis.call('HINCRBY', meta, 'n', st.added)
      end
      redis.call('PEXPIRE', meta, window)
      st.added, st.touched = 0, false
    end
  end
  inbox_dirty = {}
end
