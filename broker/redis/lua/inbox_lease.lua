-- inbox_lease.lua: check ids against the group's inbox and lease the new ones; included (not run
-- alone) by inbox_claim.lua and intake.lua, after inbox_read.lua.
--
-- base    the group's inbox zset (see inbox_claim.lua)
-- now     Unix ms; lease_ms: the lease's length; window: the group's dedup window, ms, as text
--         (stored in <inbox>:info for the scripts that record ids; '0' leaves it as it is; the
--         first one stored marks a new inbox flat, see below)
-- ids     a table holding the c message ids at ids[off + 1 .. off + c]; the first n are first
--         deliveries (they respect a live lease held elsewhere), the rest redeliveries (they take
--         over a lease whose holder timed out, or that is our own)
-- recs    the ids' 16-byte records in one string (broker.redis.keys.inbox_records)
-- lo, hi  optional: the lowest and highest id time of the records when every one is a UUIDv7/v8's
--         (inbox_seen_many skips its per-id reading when no id that old was recorded)
-- Returns one status per id, in order: 0 = leased to the caller (run it), 1 = already processed
-- (a duplicate: ack it without running), 2 = being processed elsewhere under a live lease; and
-- true when every status is 0 (a caller may then reply with the count: a reply of 500 zeros costs
-- the server about 1k instructions per id). With true, the statuses may be nil: when no id is
-- recorded nor has a score (a queue read in order), no status is made per id.
-- One ZMSCORE and one variadic ZADD per 1000 ids (not one call per id); the buckets are checked
-- with one HMGET per bucket the ids fall in (a handful per batch).
local function inbox_lease(base, now, lease_ms, window, ids, off, n, c, recs, lo, hi)
  if window ~= '0' then
    local info = base .. ':info'
    local stored = redis.call('HGET', info, 'window')
    if stored ~= window then
      -- An inbox no claim stored its window in is new: no worker of a release before flat buckets
      -- has used it, so it gets them (inbox_store.lua), unless a subscribe wrote flat = 0 first.
      if not stored then redis.call('HSETNX', info, 'flat', '1') end
      redis.call('HSET', info, 'window', window)
    end
  end
  local lease = -(now + lease_ms)
  -- unpack() fails beyond about 8000 values (Lua's C stack) and a fetch may hold more (2 x
  -- prefetch): every variadic call goes in chunks of 1000 ids.
  local CHUNK = 1000
  local scores
  if c <= CHUNK then
    scores = redis.call('ZMSCORE', base, unpack(ids, off + 1, off + c))
  else
    scores = {}
    for first = off + 1, off + c, CHUNK do
      local part = redis.call('ZMSCORE', base, unpack(ids, first, math.min(first + CHUNK - 1, off + c)))
      for j = 1, #part do scores[first - off - 1 + j] = part[j] end
    end
  end
  local seen = inbox_seen_many(base, recs, c, lo, hi)
  if next(seen) == nil then  -- none recorded (inbox_seen_many's shortcut): if none has a score either,
    local scored = false     -- every id is leased with no status of its own (the common case)
    for i = 1, c do
      if scores[i] then scored = true; break end
    end
    if not scored then
      local zadd = {}
      for i = 1, c do
        zadd[2 * i - 1] = lease - i / 1024
        zadd[2 * i] = ids[off + i]
      end
      local added = 0
      for first = 1, 2 * c, 2 * CHUNK do
        added = added + redis.call('ZADD', base, unpack(zadd, first, math.min(first + 2 * CHUNK - 1, 2 * c)))
      end
      if added == c then return nil, true end
      -- fewer added than ids: copies of an id in this batch; the loop below gives each its status
      -- (the first runs, the others wait) and sets the first copy's lease again
    end
  end
  local out, zadd, taken = {}, {}, {}
  local z, fresh = 0, true
  for i = 1, c do
    local id = ids[off + i]
    local s = scores[i]
    if s then s = tonumber(s) end
    if (s and s >= 0) or seen[i] then
      out[i] = 1
      fresh = false
    elseif (s and -s > now and i <= n) or taken[id] then
      out[i] = 2  -- a live lease elsewhere, or a second copy in this very batch (the first one runs)
      fresh = false
    else
      taken[id] = true
      zadd[z + 1] = lease - i / 1024  -- distinct scores insert faster than ties (no member compares)
      zadd[z + 2] = id
      z = z + 2
      out[i] = 0
    end
  end
  for first = 1, z, 2 * CHUNK do
    redis.call('ZADD', base, unpack(zadd, first, math.min(first + 2 * CHUNK - 1, z)))
  end
  return out, fresh
end
