-- lease.lua: acquire, renew or release a group's lease on one partition (partition ownership).
--
-- KEYS[1]  the partition's lease hash for the group: owner = instance ('' when released),
--          token = fencing token (raised by every acquisition, never lowered or deleted),
--          until = server ms the lease ends, since = server ms it was acquired
-- ARGV[1]  'acquire' | 'renew' | 'release' | 'read'
-- ARGV[2]  instance
-- ARGV[3]  lease length, ms
-- ARGV[4]  the caller's token (renew, release)
-- Times come from the server's clock (TIME), so hosts with skewed clocks agree on expiry.
-- Returns: acquire: the new token, or 0 when a live lease is held by another instance (an
-- instance may take over its own name's lease: a process restarted under the same consumer name);
-- renew: 1, or 0 when the token is no longer current (the lease was taken over);
-- release: 1, or 0 when the token is no longer current (nothing is changed);
-- read (nothing is changed): {owner, token, until, since, server seconds, microseconds}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'owner', 'token', 'until', 'since')
local owner, token, ends = state[1] or '', tonumber(state[2] or '0'), tonumber(state[3] or '0')
local op = ARGV[1]
if op == 'read' then return {owner, token, ends, tonumber(state[4] or '0'), t[1], t[2]} end
if op == 'acquire' then
  if owner ~= '' and owner ~= ARGV[2] and ends > now then return 0 end
  token = token + 1
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'token', token, 'until', now + tonumber(ARGV[3]), 'since', now)
  return token
end
if owner ~= ARGV[2] or token ~= tonumber(ARGV[4]) then return 0 end
if op == 'renew' then
  redis.call('HSET', KEYS[1], 'until', now + tonumber(ARGV[3]))
else
  redis.call('HSET', KEYS[1], 'owner', '', 'until', 0)
end
return 1
