-- job_tick.lua: fire one tick of a recurring job at most once, whoever of its instances asks first.
--
-- KEYS[1]  the job queue's partition stream (partition 0)
-- KEYS[2]  the job's state hash, sharing the stream's hash tag: last = the latest tick fired (Unix ms)
-- ARGV[1]  the tick, Unix ms
-- ARGV[2 .. end]  field/value pairs of the tick message
-- Returns 1 when the tick was fired (its message appended), 0 when this tick or a later one was fired
-- already, -1 when the job had no record (first run: the tick is recorded as the baseline, not fired).
-- A tick never fires twice; ticks missed while no instance ran collapse into the latest one.
local tick = tonumber(ARGV[1])
local last = redis.call('HGET', KEYS[2], 'last')
if last and tonumber(last) >= tick then return 0 end
redis.call('HSET', KEYS[2], 'last', ARGV[1])
if not last then return -1 end
local fields = {}
for i = 2, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[1], '*', unpack(fields))
redis.call('HINCRBY', KEYS[2], 'fired', 1)
return 1
