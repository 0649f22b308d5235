-- schedule_read.lua: read scheduled messages of one partition (for list and show; changes nothing).
--
-- KEYS[1]  the partition's scheduled zset (member = message id, score = due, Unix ms)
-- KEYS[2]  the partition's scheduled envelopes hash (message id -> cmsgpack of field/value list)
-- ARGV[1]  at most this many, earliest due first (when no ids are given)
-- ARGV[2 .. end]  message ids to read (absent ones are skipped)
-- Returns a list of {message id, due ms (string), field, value, ...}.
local ids = {}
if #ARGV > 1 then
  for i = 2, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
end
local out = {}
for i = 1, #ids do
  local due = redis.call('ZSCORE', KEYS[1], ids[i])
  local packed = redis.call('HGET', KEYS[2], ids[i])
  if due and packed then
    local row = {ids[i], due}
    local fields = cmsgpack.unpack(packed)
    for j = 1, #fields do row[#row + 1] = fields[j] end
    out[#out + 1] = row
  end
end
return out
