-- worker_beat.lua: a worker process's heartbeat (framework status, the dashboard's live workers).
--
-- KEYS[1]  the namespace's workers hash: field = worker name, value = "<server ms>|<ttl ms>|<JSON>"
-- ARGV[1]  worker name
-- ARGV[2]  ttl, ms: the worker beats again within it (else it is shown as gone)
-- ARGV[3]  JSON: {"groups": [[destination, group], ...], "info": {...}}; '' to leave (the entry
--          stays, with ttl -1: shown as gone from now on)
-- Workers whose last beat is more than an hour old are forgotten. Returns the server time, ms.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[3] == '' then
  local v = redis.call('HGET', KEYS[1], ARGV[1])
  if v then
    local body = string.match(v, '^%d+|%-?%d+|(.*)$')
    if body then
      redis.call('HSET', KEYS[1], ARGV[1], now .. '|-1|' .. body)
    end
  end
  return now
end
redis.call('HSET', KEYS[1], ARGV[1], now .. '|' .. ARGV[2] .. '|' .. ARGV[3])
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local seen = tonumber(string.match(all[i + 1], '^(%d+)|'))
  if seen == nil or seen < now - 3600000 then
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return now
