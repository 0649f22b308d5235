-- owned_intake.lua: take entries of an owned partition for its lease holder only (fenced intake).
--
-- A partition's owner reads and claims through this script, so a read or a claim that reaches the
-- server after its sender lost the lease (a process resumed after a pause with the command already
-- past its local lease check, or a command re-sent after a timeout) takes nothing: entries taken
-- then would stay pending under the old owner while the new one reads later entries of their keys.
--
-- KEYS[1]  the partition's lease hash for the group (lease.lua: owner, token)
-- KEYS[2]  the partition stream
-- KEYS[3]  the group's redeliver stream for the partition ('read' only)
-- ARGV[1]  the caller: the lease's owner and the group's consumer name
-- ARGV[2]  the caller's fencing token
-- ARGV[3]  'read' | 'claim'
-- ARGV[4]  the group
-- read:  ARGV[5] count. XREADGROUP '>' of both streams (never blocking). Returns {1, reply} with
--        entries, or {0, last generated id of KEYS[2], of KEYS[3]} with none: the caller may then
--        wait for a newer entry with a plain XREAD BLOCK from those ids, which takes nothing.
-- claim: ARGV[5] min idle ms, ARGV[6] start id, ARGV[7] count. XAUTOCLAIM of KEYS[2]; returns {1, reply}.
-- Returns {-1} when the lease's owner or token is not the caller's (nothing is taken).
local state = redis.call('HMGET', KEYS[1], 'owner', 'token')
if state[1] ~= ARGV[1] or tonumber(state[2] or '0') ~= tonumber(ARGV[2]) then return {-1} end
if ARGV[3] == 'claim' then
  return {1, redis.call('XAUTOCLAIM', KEYS[2], ARGV[4], ARGV[1], ARGV[5], ARGV[6], 'COUNT', ARGV[7])}
end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[4], ARGV[1], 'COUNT', ARGV[5],
  'STREAMS', KEYS[2], KEYS[3], '>', '>')
if reply then return {1, reply} end
local last = {0}
for i = 2, 3 do
  local info = redis.call('XINFO', 'STREAM', KEYS[i])
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then last[i] = info[j + 1] end
  end
end
return last
