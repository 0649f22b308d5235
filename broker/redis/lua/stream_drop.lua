-- stream_drop.lua: deleting a queue's acknowledged entries, included (not run alone) by ack.lua and
-- commit_effects.lua, after their XACK.
--
-- XDEL finds and marks each entry: about 8k server instructions per entry (Valkey 9.1, measured),
-- as much as the rest of a plain ack. XTRIM MINID drops whole runs of the stream's oldest entries
-- for about 130 per entry. A queue (or a group's redeliver stream) is read by one group from its
-- first entry, in id order (broker.redis.topology refuses a second group on a queue), so every
-- entry below the group's oldest pending entry was delivered and is no longer pending:
-- acknowledged. When nothing is pending, every entry up to the group's last delivered id is. And
-- every ack deletes all it acknowledged (by this trim or by XDEL), so what lies below that bound
-- is exactly what this call acknowledged there: the entries of a batch acked in order (a
-- backlog's, or any batch with no older message still running) go by one trim to the bound, and
-- when the trim removed fewer entries than the call acknowledged, some of them lie above an older
-- entry still running and every one goes by XDEL, as before. Entries at or above the bound are
-- never touched: pending ones, and ones the group has not read.
-- Only commands of the documented worker ACL are used (XPENDING, XINFO GROUPS, XTRIM, XDEL).
local STREAM_TRIM_FROM = 8  -- fewer entries than this go by XDEL alone (the latency path: one or two)

-- The group's last delivered id on stream (XINFO GROUPS), or nil.
local function stream_last_delivered(stream, group)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, last = nil, nil
    for j = 1, #g, 2 do
      if g[j] == 'name' then name = g[j + 1] elseif g[j] == 'last-delivered-id' then last = g[j + 1] end
    end
    if name == group then return last end
  end
  return nil
end

-- Delete the entries ids[from..to] of stream, which the group has just acknowledged (acked of them
-- were pending: XACK's reply; the rest were settled and deleted by an earlier call).
local function stream_drop(stream, group, ids, from, to, acked)
  if to < from then return end
  if to - from + 1 >= STREAM_TRIM_FROM and acked > 0 then
    local gone = 0
    local pending = redis.call('XPENDING', stream, group)
    if pending[1] > 0 then
      gone = redis.call('XTRIM', stream, 'MINID', pending[2])  -- below the oldest pending entry
    else
      local last = stream_last_delivered(stream, group)
      if last then  -- everything delivered is acknowledged: up to and including the last delivered
        gone = redis.call('XTRIM', stream, 'MINID', last) + redis.call('XDEL', stream, last)
      end
    end
    if gone >= acked then return end
  end
  redis.call('XDEL', stream, unpack(ids, from, to))
end
