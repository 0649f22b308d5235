-- inbox_hashed.lua: processed ids that are not UUIDv7/v8 (ids the application chose), kept as a
-- 128-bit hash in at most about 20 bytes each; included by inbox_read.lua (not run alone): the
-- lookups here, the recording in inbox_hashed_record.lua.
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

-- The 16 bytes of a UUID's 8-4-4-4-12 hex digits (checked by the caller): six numbers and plain
-- arithmetic, no call per byte or per group of digits (a C call costs the server more than the
-- arithmetic around it: about 5k instructions for the id here, 21k by gsub and inbox_hex16).
local function inbox_uuid16(id)
  local a = tonumber(string.sub(id, 1, 8), 16)
  local b = tonumber(string.sub(id, 10, 13), 16)
  local c = tonumber(string.sub(id, 15, 18), 16)
  local d = tonumber(string.sub(id, 20, 23), 16)
  local e = tonumber(string.sub(id, 25, 30), 16)
  local f = tonumber(string.sub(id, 31, 36), 16)
  local a3 = a % 256; a = (a - a3) / 256
  local a2 = a % 256; a = (a - a2) / 256
  local a1 = a % 256
  local e2 = e % 256; e = (e - e2) / 256
  local e1 = e % 256
  local f2 = f % 256; f = (f - f2) / 256
  local f1 = f % 256
  return string.char((a - a1) / 256, a1, a2, a3, (b - b % 256) / 256, b % 256, (c - c % 256) / 256, c % 256,
    (d - d % 256) / 256, d % 256, (e - e1) / 256, e1, e2, (f - f1) / 256, f1, f2)
end

-- The 16-byte inbox record of a message id (text), as broker.redis.keys.inbox_record makes it.
local function inbox_record_of(id)
  if #id == 36 and string.find(id, INBOX_UUID78) then
    return inbox_uuid16(id)
  end
  local raw = inbox_hex16(redis.sha1hex(id))
  return string.sub(raw, 1, 6) .. '\1' .. string.sub(raw, 8, 16)
end

local inbox_hstate = nil  -- {gens = {{s, b, n}, ...}, window, now, dirty} once read

-- (state of one call: a function library's outlives it, so each call starts afresh)
local function inbox_hashed_begin() inbox_hstate = nil end

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

