-- commit_effects.lua: apply a handler's Redis writes, its outgoing messages, the inbox mark and the
-- ack in one atomic step, unless the message was already processed (then only ack it).
--
-- KEYS[1]  stream the entry was read from
-- KEYS[2]  the group's inbox zset (leases, and final scores >= 0 for ids that are not UUIDv7/v8;
--          see inbox_claim.lua); UUIDv7/v8 ids are checked and recorded in the inbox's buckets
--          (inbox_store.lua, included below), their lease removed from the zset
-- KEYS[3]  the group's attempts hash
-- KEYS[4]  the group's DLQ stream (written only when the writes fail half-way)
-- KEYS[5]  the partition's lease hash for the group (lease.lua): the fencing check
-- KEYS[6 ..]  the keys the writes and outgoing messages touch (declared for Cluster routing)
-- ARGV[1]  group
-- ARGV[2]  "1" to XDEL the entry after XACK
-- ARGV[3]  now, Unix ms
-- ARGV[4]  entry id
-- ARGV[5]  message id
-- ARGV[6]  n: number of the handler's Redis commands
-- ARGV[7]  m: number of outgoing messages (XADD commands run after the handler's commands)
-- ARGV[8]  r: number of field/value pairs of the dead-letter reason that follow
-- ARGV[9 .. 8 + 2r]  the reason pairs (dlq-handler, dlq-attempts, ...)
-- ARGV[9 + 2r ..]  n + m commands; each is: argument count c, then c arguments
-- ARGV[#ARGV]  the caller's fencing token, or '' when the partition is not owned (no check)
-- A handler command {'__EXPECT__', key, field, value} (RedisEffects.expect) is a guard, not a write:
-- before any write, HGET key field must equal value ('' = absent), else nothing is done and -2 is
-- returned (the entry stays pending; the caller runs the handler again: an optimistic check).
--
-- Returns 1 when the effects were applied; 0 when the message was a duplicate (only acked) or
-- the entry is no longer pending for the group (settled already: nothing is done, so a commit
-- repeated after a failure below applies nothing again); -1 (nothing done) when the fencing token
-- is not current (another instance owns the partition now); -2 (nothing done) when a guard failed.
--
-- Redis has no rollback, so the commands run with pcall and stop at the first error. The commands
-- before it stay applied (a retry would apply them twice), so this same call dead-letters the
-- message (its fields, or dlq-empty = 1 if the entry is gone, plus the reason pairs, dlq-reason,
-- dlq-error-type and dlq-error-message), acks it, releases its inbox lease (a redrive runs the
-- handler again) and drops its attempts counter; the outgoing messages are not sent (unless one of
-- them failed: those before it were). Returns {DLQ entry id, error, commands applied}.
-- A failure at the first command is dead-lettered too: errors a retry could outlive (OOM,
-- READONLY, NOREPLICAS) refuse the first write and the DLQ write alike, so the script raises
-- having written nothing, and the entry stays pending.
--#include inbox_store
local fence = ARGV[#ARGV]
if fence ~= '' and redis.call('HGET', KEYS[5], 'token') ~= fence then return -1 end  -- fenced: no effect
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[4], ARGV[4], 1)
if #pending == 0 then return 0 end
-- unpack() below fails past about 8000 values (Lua's C stack), which would stop the script after
-- the commands before it were applied and leave the entry pending: a retry would apply them again.
-- So every command's size is checked before any runs; a failed attempt then has changed nothing.
local MAX_ARGS = 7900
do
  local n, m, r = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  local pos = 9 + 2 * r
  for i = 1, n + m do
    local c = tonumber(ARGV[pos])
    if c > MAX_ARGS then
      local what = i <= n and string.format('Redis command %d of %d (%s)', i, n, string.upper(ARGV[pos + 1]))
        or string.format('outgoing message %d of %d', i - n, m)
      return redis.error_reply(string.format('ERR effects not applied: %s has %d arguments, more than the %d '
        .. 'a script can pass; split it into smaller commands', what, c, MAX_ARGS))
    end
    pos = pos + c + 1
  end
end
local s = redis.call('ZSCORE', KEYS[2], ARGV[5])
local bin = inbox_compact(ARGV[5])
local done = (s and tonumber(s) >= 0) or (bin ~= '' and inbox_seen(KEYS[2], bin))
if not done then
  local n, m, r = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  local pos = 9 + 2 * r
  for i = 1, n do  -- guards first: a failed one means nothing at all is written
    local c = tonumber(ARGV[pos])
    if ARGV[pos + 1] == '__EXPECT__' and (redis.call('HGET', ARGV[pos + 2], ARGV[pos + 3]) or '') ~= ARGV[pos + 4] then
      return -2
    end
    pos = pos + c + 1
  end
  pos = 9 + 2 * r
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
      local entry = redis.call('XRANGE', KEYS[1], ARGV[4], ARGV[4])
      if #entry > 0 then
        for _, v in ipairs(entry[1][2]) do fields[#fields + 1] = v end
      else
        fields = {'dlq-empty', '1'}
      end
      for k = 9, 8 + 2 * r do fields[#fields + 1] = ARGV[k] end
      fields[#fields + 1] = 'dlq-reason'
      fields[#fields + 1] = reason
      fields[#fields + 1] = 'dlq-error-type'
      fields[#fields + 1] = 'redis.exceptions.ResponseError'
      fields[#fields + 1] = 'dlq-error-message'
      fields[#fields + 1] = err
      local dead = redis.call('XADD', KEYS[4], '*', unpack(fields))
      redis.call('XACK', KEYS[1], ARGV[1], ARGV[4])
      if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], ARGV[4]) end
      if s and tonumber(s) < 0 then redis.call('ZREM', KEYS[2], ARGV[5]) end
      redis.call('HDEL', KEYS[3], ARGV[5])
      return {dead, err, i - 1}
    end
    pos = pos + c + 1
  end
  if bin ~= '' then
    inbox_record(KEYS[2], bin)
    inbox_flush(KEYS[2])
    redis.call('ZREM', KEYS[2], ARGV[5])
  else
    redis.call('ZADD', KEYS[2], ARGV[3], ARGV[5])
  end
end
redis.call('HDEL', KEYS[3], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[4])
if ARGV[2] == '1' then redis.call('XDEL', KEYS[1], ARGV[4]) end
if done then return 0 end
return 1
