-- commit_effects.lua: for each of k messages read from one stream by one group, apply the handler's
-- Redis writes, its outgoing messages, the inbox mark and the ack in one step, unless the message was
-- already processed (then only ack it). The whole call is atomic; each message's outcome is its own,
-- exactly as if it had been committed alone (the runtime sends the commits of many handlers together).
--
-- KEYS[1]  stream the entries were read from
-- KEYS[2]  the group's inbox zset (leases, and final scores >= 0 for ids that are not UUIDv7/v8;
--          see inbox_claim.lua); UUIDv7/v8 ids are checked and recorded in the inbox's buckets
--          (inbox_store.lua, included below), their lease removed from the zset
-- KEYS[3]  the group's attempts hash
-- KEYS[4]  the group's DLQ stream (written only when a message's writes fail half-way)
-- KEYS[5]  the partition's lease hash for the group (lease.lua): the fencing check
-- KEYS[6 ..]  the keys the writes and outgoing messages touch (declared for Cluster routing)
-- ARGV[1]  group
-- ARGV[2]  "1" to delete each entry after XACK (stream_drop.lua)
-- ARGV[3]  now, Unix ms
-- ARGV[4]  the caller's fencing token, or '' when the partition is not owned (no check)
-- ARGV[5]  k: number of messages
-- ARGV[6]  q: dead-letter reason field/value pairs every message of the call shares (the handler,
--          destination, partition, group), then the 2q values; then for each message:
--   entry id, message id, its 16-byte inbox record (broker.redis.keys.inbox_records: 16 zero bytes for
--   ids that are not UUIDv7/v8; computed by the caller, as Lua spends microseconds per id on it), n (the handler's
--   Redis commands), m (outgoing messages: XADD commands run after the handler's), r (its own
--   field/value pairs of the dead-letter reason), the 2r reason values, then n + m commands,
--   each: argument count c, then c arguments
-- A handler command {'__EXPECT__', key, field, value} (RedisEffects.expect) is a guard, not a write:
-- before any write of its message, HGET key field must equal value ('' = absent), else nothing is
-- done for that message and its result is -2 (the entry stays pending; the caller runs the handler
-- again: an optimistic check).
--
-- Returns -1 (nothing done for any message) when the fencing token is not current (another instance
-- owns the partition now); else a list of k results, one per message: 1 when the effects were
-- applied; 0 when the message was a duplicate (only acked) or its entry is no longer pending for the
-- group (settled already: nothing is done, so a commit repeated after a failure below applies nothing
-- again); -2 (nothing done) when a guard failed; {'E', error} (nothing done) when the message cannot
-- be committed (a command with too many arguments, or the server refused its first write and its
-- dead letter alike: OOM, READONLY, NOREPLICAS, errors a retry could outlive; the entry stays pending);
-- {DLQ entry id, error, commands applied} when a command failed (below).
--
-- Redis has no rollback, so a message's commands run with pcall and stop at the first error. The
-- commands before it stay applied (a retry would apply them twice), so this same call dead-letters
-- the message (its fields, or dlq-empty = 1 if the entry is gone, plus the reason pairs, dlq-entry-id,
-- dlq-dead-at (now), dlq-first-failed-at unless a reason pair gives it (the entry's first-failed-at
-- field, else now), dlq-reason, dlq-error-type and dlq-error-message), acks it, releases its inbox
-- lease (a redrive runs the handler again) and drops its attempts counter; its outgoing messages are
-- not sent (unless one of them failed: those before it were). The other messages of the call go on.
--#include inbox_store
--#include stream_drop
if ARGV[4] ~= '' and redis.call('HGET', KEYS[5], 'token') ~= ARGV[4] then return -1 end  -- fenced: no effect
-- unpack() below fails past about 8000 values (Lua's C stack), which would stop the script after
-- the commands before it were applied and leave the entry pending: a retry would apply them again.
-- So every command's size is checked before any of its message's commands run.
local MAX_ARGS = 7900
local k = tonumber(ARGV[5])
local msgs = {}
local bins = {}
do
  local pos = 7 + 2 * tonumber(ARGV[6])
  for i = 1, k do
    local e = {entry = ARGV[pos], id = ARGV[pos + 1], n = tonumber(ARGV[pos + 3]), m = tonumber(ARGV[pos + 4]),
      r = tonumber(ARGV[pos + 5])}
    bins[i] = ARGV[pos + 2]
    e.reason = pos + 6  -- first reason value
    e.first = e.reason + 2 * e.r  -- first command's argument count
    pos = e.first
    for j = 1, e.n + e.m do
      local c = tonumber(ARGV[pos])
      if c > MAX_ARGS and not e.err then
        local what = j <= e.n and string.format('Redis command %d of %d (%s)', j, e.n, string.upper(ARGV[pos + 1]))
          or string.format('outgoing message %d of %d', j - e.n, e.m)
        e.err = string.format('ERR effects not applied: %s has %d arguments, more than the %d '
          .. 'a script can pass; split it into smaller commands', what, c, MAX_ARGS)
      end
      pos = pos + c + 1
    end
    msgs[i] = e
  end
end
local seen = inbox_seen_many(KEYS[2], table.concat(bins), k)
-- Every message's inbox zset score (its lease, or a final record for ids that are not UUIDv7/v8)
-- in one ZMSCORE; the settling writes of all messages go at the end, one variadic call each (the
-- call is atomic: nothing else runs in between, and a message's own checks only read what no
-- message of this call writes, except its inbox record, which settled_ids stands for).
-- (k is at most broker.redis.batching.MAX_BATCH, 64: every variadic call below passes its ids at once.)
local scores
do
  local ids = {}
  for i = 1, k do ids[i] = msgs[i].id end
  scores = redis.call('ZMSCORE', KEYS[2], unpack(ids))
end
local settled_ids = {}  -- message ids applied or acked as duplicates in this call
local results = {}
local acks, counters, released, finals = {}, {}, {}, {}
local function settle(e)
  counters[#counters + 1] = e.id
  acks[#acks + 1] = e.entry
end
local function commit(e, bin, was_seen, s)
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], e.entry, e.entry, 1)
  if #pending == 0 then return 0 end
  if e.err then return {'E', e.err} end
  if s then s = tonumber(s) end
  local done = (s and s >= 0) or was_seen or settled_ids[e.id]
  if done then
    settle(e)
    return 0
  end
  local n, m = e.n, e.m
  local pos = e.first
  for _ = 1, n do  -- guards first: a failed one means nothing at all is written
    local c = tonumber(ARGV[pos])
    if ARGV[pos + 1] == '__EXPECT__' and (redis.call('HGET', ARGV[pos + 2], ARGV[pos + 3]) or '') ~= ARGV[pos + 4] then
      return -2
    end
    pos = pos + c + 1
  end
  pos = e.first
  for i = 1, n + m do
    local c = tonumber(ARGV[pos])
    local cmd = {}
    for j = 1, c do cmd[j] = ARGV[pos + j] end
    local res = (cmd[1] == '__EXPECT__') and 1 or redis.pcall(unpack(cmd))
    if type(res) == 'table' and res.err then
      local err = res.err
      local what
      if i <= n then
        what = string.format('Redis command %d of %d (%s)', i, n, string.upper(cmd[1]))
      else
        what = string.format('outgoing message %d of %d (XADD to %s)', i - n, m, cmd[2])
      end
      local reason
      if i == 1 then
        reason = 'effects not applied: ' .. what .. ' failed: ' .. err .. '; nothing was applied'
      else
        local applied
        if i <= n then
          applied = string.format('the %d command(s) before it were applied', i - 1)
        else
          applied = string.format('the %d Redis command(s) and %d outgoing message(s) before it were applied',
            n, i - n - 1)
        end
        reason = 'effects partially applied: ' .. what .. ' failed: ' .. err .. '; ' .. applied ..
          ' and are not rolled back (Redis has no rollback)'
      end
      local fields = {}
      local first_failed = ARGV[3]  -- when it first failed: a retried copy says, else now
      local entry = redis.call('XRANGE', KEYS[1], e.entry, e.entry)
      if #entry > 0 then
        local flat = entry[1][2]
        for x, v in ipairs(flat) do
          fields[#fields + 1] = v
          if x % 2 == 1 and v == 'first-failed-at' then first_failed = flat[x + 1] end
        end
      else
        fields = {'dlq-empty', '1'}
      end
      for x = 7, 6 + 2 * tonumber(ARGV[6]) do fields[#fields + 1] = ARGV[x] end
      for x = e.reason, e.reason + 2 * e.r - 1, 2 do
        if ARGV[x] == 'dlq-first-failed-at' then first_failed = nil end  -- the caller's own
        fields[#fields + 1] = ARGV[x]
        fields[#fields + 1] = ARGV[x + 1]
      end
      fields[#fields + 1] = 'dlq-entry-id'
      fields[#fields + 1] = e.entry
      fields[#fields + 1] = 'dlq-dead-at'
      fields[#fields + 1] = ARGV[3]
      if first_failed then
        fields[#fields + 1] = 'dlq-first-failed-at'
        fields[#fields + 1] = first_failed
      end
      fields[#fields + 1] = 'dlq-reason'
      fields[#fields + 1] = reason
      fields[#fields + 1] = 'dlq-error-type'
      fields[#fields + 1] = 'redis.exceptions.ResponseError'
      fields[#fields + 1] = 'dlq-error-message'
      fields[#fields + 1] = err
      local dead = redis.pcall('XADD', KEYS[4], '*', unpack(fields))
      if type(dead) == 'table' and dead.err then
        if i == 1 then return {'E', err} end  -- the server refuses writes: nothing written, stays pending
        return redis.error_reply(dead.err)  -- (cannot happen: a write went through just before)
      end
      if s and s < 0 then released[#released + 1] = e.id end  -- lease released: a redrive runs it
      settle(e)
      return {dead, err, i - 1}
    end
    pos = pos + c + 1
  end
  if string.byte(bin, 7) ~= 0 then  -- a UUIDv7/v8 id (a zero record: any other id, kept in the zset)
    inbox_record_all(bin, 1)
    released[#released + 1] = e.id
  else
    finals[#finals + 1] = e.id
  end
  settled_ids[e.id] = true
  settle(e)
  return 1
end
for i = 1, k do
  results[i] = commit(msgs[i], bins[i], seen[i], scores[i])
end
if #acks > 0 then
  local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(acks))
  if ARGV[2] == '1' then stream_drop(KEYS[1], ARGV[1], acks, 1, #acks, acked) end
  redis.call('HDEL', KEYS[3], unpack(counters))
end
if #released > 0 then redis.call('ZREM', KEYS[2], unpack(released)) end
if #finals > 0 then
  local zadd = {}
  for i, id in ipairs(finals) do
    zadd[2 * i - 1] = tonumber(ARGV[3]) + i / 1024  -- distinct scores insert faster than ties
    zadd[2 * i] = id
  end
  redis.call('ZADD', KEYS[2], unpack(zadd))
end
inbox_flush(KEYS[2])
return results
