-- inbox_hashed_record.lua: recording ids kept by their hash (inbox_hashed.lua has the layout);
-- included by inbox_store.lua, after inbox_hashed.lua (readers only need that one).
local INBOX_HFILL = 64      -- ids per bucket a generation is sized for
local INBOX_HFIRST = 60000  -- the first generation's length, ms
local INBOX_HMAXB = 24      -- at most 2^24 buckets per generation (the record's first 3 bytes)
local INBOX_HGENS = 48      -- generations listed at most (about 12 live: ramp-up and early ends)

-- The longest generation i of st.gens may last (a quarter of the window; the first a minute, each
-- next one at most four times as long as the one before).
local function inbox_hlength(st, i)
  local long = math.max(math.floor(st.window / 4), 1)
  local prev = st.gens[i - 1]
  return math.min(long, prev and 4 * (st.gens[i][1] - prev[1]) or INBOX_HFIRST)
end

-- The B whose 2^B buckets hold about INBOX_HFILL each of ids ids.
local function inbox_hbits(ids)
  local b = 0
  while b < INBOX_HMAXB and INBOX_HFILL * 2 ^ b < ids do b = b + 1 end
  return b
end

-- The generation count new records go into: the last one, or a new one when the last has run
-- its length or would fill its buckets past an average of 1.25 x INBOX_HFILL (past 128 ids a
-- bucket leaves the compact encoding). A new one is sized from the last one's rate over its own
-- length, at most 4 times the last one's buckets (a burst does not size a day), and at least
-- enough for this call's records.
local function inbox_hcurrent(st, count)
  local gens, now = st.gens, st.now
  local cur = gens[#gens]
  local long = math.max(math.floor(st.window / 4), 1)
  if cur then
    local age = now - cur[1]
    local length = inbox_hlength(st, #gens)
    local full = cur[2] < INBOX_HMAXB and cur[3] + count > 1.25 * INBOX_HFILL * 2 ^ cur[2]
    if age < length and not full then return cur end
    local rate = (cur[3] + count) / math.max(age, 1)
    local b = math.min(inbox_hbits(rate * math.min(long, 4 * math.max(age, 1000))), cur[2] + 2)
    b = math.max(b, inbox_hbits(count))
    if now <= cur[1] then now = cur[1] + 1 end  -- (starts strictly increase)
    gens[#gens + 1] = {now, b, 0}
  else
    gens[1] = {now, inbox_hbits(count), 0}
  end
  while #gens > INBOX_HGENS or (gens[2] and gens[2][1] + st.window < st.now) do table.remove(gens, 1) end
  st.dirty = true
  return gens[#gens]
end

-- Record hashed records (a list of 16-byte strings) in the current generation: per bucket one
-- HSET and one PEXPIREAT (the generation's latest end plus the window: every id of it is kept
-- at least the window, with no count or list of buckets to keep; a delete goes through all 2^B).
local function inbox_hrecord(base, recs)
  if #recs == 0 then return end
  local st = inbox_hread(base)
  local gen = inbox_hcurrent(st, #recs)
  local expiry = gen[1] + inbox_hlength(st, #st.gens) + st.window
  local n, _, top, fields = inbox_hsorted(recs)
  local prefix = base .. ':h:' .. string.format('%x', gen[1]) .. ':'
  local div = 2 ^ (24 - gen[2])
  local added, args = 0, {}
  local k = 1
  while k <= n do
    local p = math.floor(top[k] / div)
    local c = 0
    repeat
      args[c + 1], args[c + 2] = fields[k], '1'
      c = c + 2
      k = k + 1
    until k > n or math.floor(top[k] / div) ~= p
    local key = prefix .. string.format('%x', p)
    added = added + redis.call('HSET', key, unpack(args, 1, c))
    redis.call('PEXPIREAT', key, expiry)
  end
  if added > 0 or st.dirty then
    gen[3] = gen[3] + added
    local parts = {}
    for i, g in ipairs(st.gens) do parts[i] = string.format('%d:%d:%d', g[1], g[2], g[3]) end
    redis.call('HSET', base .. ':h', 'g', table.concat(parts, ','))
    redis.call('PEXPIREAT', base .. ':h', expiry)
    st.dirty = false
  end
end
