-- workers_read.lua: the namespace's worker heartbeats with the server time they are judged by, from the
-- node holding them (a Redis Cluster pipelines no TIME).
--
-- KEYS[1]  the namespace's workers hash (see worker_beat.lua)
-- Returns {seconds, microseconds, {field, value, ...}}.
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGETALL', KEYS[1])}
