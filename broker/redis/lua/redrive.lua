-- redrive.lua: give one dead letter back to its group (only that group), as a fresh first attempt.
--
-- KEYS[1]  the group's DLQ stream
-- KEYS[2]  the group's redeliver stream (read by that group alone)
-- ARGV[1]  DLQ entry id
-- The original fields are copied without the dlq-* reason fields, "attempt" and "first-failed-at",
-- so the message starts over under its handler's retry policy; the DLQ entry is deleted in the
-- same step. Returns the new entry id, or false when the dead letter no longer exists.
local rows = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #rows == 0 then return false end
local flat = rows[1][2]
local fields = {}
for i = 1, #flat, 2 do
  local name = flat[i]
  if string.sub(name, 1, 4) ~= 'dlq-' and name ~= 'attempt' and name ~= 'first-failed-at' then
    fields[#fields + 1] = name
    fields[#fields + 1] = flat[i + 1]
  end
end
if #fields == 0 then return false end
local id = redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('XDEL', KEYS[1], ARGV[1])
return id
