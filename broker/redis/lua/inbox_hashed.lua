-- inbox_hashed.lua: processed ids that are not UUIDv7/v8 (ids the application chose), kept as a
-- 128-bit hash in at most about 20 bytes each; included by inbox_store.lua (not run alone).
--
-- An id's record is the first 16 bytes of its SHA-1 with the 7th byte set to 1 (its "version": 7
-- or 8 in a UUID record, 0 in the zero record older clients send); broker.redis.keys.inbox_record
-- computes the same bytes in Python and inbox_record_of below in Lua. With no time in the id, the
-- records go by the time they are written, into generations of buckets:
--
--   <inbox>:h           hash  g = the generations "S:B:N,..." in order: from Unix ms S on, records
--                             go into 2^B buckets by the record's top B bits; N recorded there
--   <inbox>:h:<S>:<p>   hash  field = record bytes 4..16 (13 bytes), value 1 (S hex; p: the top B bits, hex)
--
-- A generation lasts a quarter of the dedup window (the first one a minute, each next one at most
-- four times as long as the one before), and its B is chosen from the rate of the one before so
-- its buckets hold about 64 ids (the server's compact listpack encoding holds up to 128); one
-- whose buckets fill past 80 ids on average ends early (inbox_hcurrent). Every bucket of a
-- generation expires a window after the generation's latest end, so an id is remembered for at
-- least the window and at most a generation longer; a lookup reads the bucket of each generation
-- that may still hold ids (5 in a steady state, about 10 in a group's first window). Collision odds: two
-- different ids collide only if 96 + B bits of their hashes agree: for 10^8 ids in one window,
-- under 10^-13.
local INBOX_HASHED = 1      -- the 7th byte of a hashed record
local INBOX_HFILL = 64      -- ids per bucket a generation is sized for
local INBOX_HFIRST = 60000  -- the first generation's length, ms
local INBOX_HMAXB = 24      -- at most 2^24 buckets per generation (the record's first 3 bytes)
local INBOX_HGENS = 48      -- generations listed at most (about 12 live: ramp-up and early ends)

local INBOX_UUID78 = '^%x%x%x%x%x%x%x%x%-%x%x%x%x%-[78]%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$'

-- The 4 bytes of 8 hex digits.
local function inbox_hex4(h)
  local x = tonumber(h, 16)
  return string.char(math.floor(x / 16777216), math.floor(x / 65536) % 256, math.floor(x / 256) % 256, x % 256)
end

-- The 16 bytes of 32 hex digits.
local function inbox_hex16(h)
  return inbox_hex4(string.sub(h, 1, 8)) .. inbox_hex4(string.sub(h, 9, 16)) .. inbox_hex4(string.sub(h, 17, 24))
    .. inbox_hex4(string.sub(h, 25, 32))
end

-- The 16-byte inbox record of a message id (text), as broker.redis.keys.inbox_record makes it.
local function inbox_record_of(id)
  if #id == 36 and string.find(id, INBOX_UUID78) then
    return inbox_hex16(string.gsub(id, '-', ''))
  end
  local raw = inbox_hex16(redis.sha1hex(id))
  return string.sub(raw, 1, 6) .. '\1' .. string.sub(raw, 8, 16)
end

local inbox_hstate = nil  -- {gens = {{s, b, n}, ...}, window, now, dirty} once read

local function inbox_hread(base)
  if inbox_hstate then return inbox_hstate end
  local v = redis.call('HGET', base .. ':h', 'g')
  local gens = {}
  if v then
    for s, b, n in string.gmatch(v, '(%d+):(%d+):(%d+)') do
      gens[#gens + 1] = {tonumber(s), tonumber(b), tonumber(n)}
    end
  end
  local t = redis.call('TIME')
  inbox_hstate = {
    gens = gens,
    window = tonumber(redis.call('HGET', base .. ':info', 'window')) or 7 * 24 * 3600 * 1000,
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
  }
  return inbox_hstate
end

-- Records in bucket order: sorted (by the server's own string compare: no Lua call per compare), ids
-- of one bucket of any generation come together. Returns n, their positions in the caller's
-- list (pos), their top 24 bits (top) and their 13-byte fields; recs[k] is the k-th record.
local function inbox_hsorted(recs)
  local keyed = {}
  for k, rec in ipairs(recs) do keyed[k] = rec .. string.char(math.floor(k / 256), k % 256) end
  table.sort(keyed)
  local pos, top, fields = {}, {}, {}
  for k, sk in ipairs(keyed) do
    local a, b, c = string.byte(sk, 1, 3)
    local hi, lo = string.byte(sk, 17, 18)
    pos[k], top[k], fields[k] = hi * 256 + lo, a * 65536 + b * 256 + c, string.sub(sk, 4, 16)
  end
  return #keyed, pos, top, fields
end

-- Which hashed records are recorded: sets seen[at[k]] = true for each record recs[k] found. One
-- HMGET per bucket of each generation that may hold ids (records of one bucket come together).
local function inbox_hseen(base, at, recs, seen)
  local st = inbox_hread(base)
  local gens = st.gens
  if #gens == 0 then return end
  local n, pos, top, fields = inbox_hsorted(recs)
  local args, where = {}, {}
  for gi = #gens, 1, -1 do
    local gen, nxt = gens[gi], gens[gi + 1]
    if nxt and nxt[1] + st.window < st.now then break end  -- every bucket of this one has expired
    local prefix = base .. ':h:' .. string.format('%x', gen[1]) .. ':'
    local div = 2 ^ (24 - gen[2])
    local k = 1
    while k <= n do
      local p = math.floor(top[k] / div)
      local c = 0
      repeat
        local i = at[pos[k]]
        if not seen[i] then
          c = c + 1
          args[c], where[c] = fields[k], i
        end
        k = k + 1
      until k > n or math.floor(top[k] / div) ~= p
      if c > 0 then
        local got = redis.call('HMGET', prefix .. string.format('%x', p), unpack(args, 1, c))
        for j = 1, c do
          if got[j] then seen[where[j]] = true end
        end
      end
    end
  end
end

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
