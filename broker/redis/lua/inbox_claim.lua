-- inbox_claim.lua: check a fetched batch against the group's inbox and lease the new messages.
--
-- KEYS[1]  the group's inbox zset: member = message id text; score < 0: leased to a running handler
--          until -score Unix ms; score >= 0: processed at that Unix ms (final), for records
--          written by older clients (read until trimmed). Processed ids are in buckets named after
--          KEYS[1] (inbox_store.lua: UUIDv7/v8 ids by their time; inbox_hashed.lua: any other id by
--          its hash); every key shares KEYS[1]'s hash tag, so a Cluster routes them together.
-- ARGV[1]  now, Unix ms
-- ARGV[2]  lease length, ms
-- ARGV[3]  n, first-delivery ids (they respect a live lease held elsewhere); the rest are redelivered
--          ids (their previous holder timed out or is us: take over)
-- ARGV[4]  the group's dedup window, ms (stored in <inbox>:info for the scripts that record ids;
--          0 leaves it as it is)
-- ARGV[5]  c, the number of ids
-- ARGV[6 .. 5+c]      message ids (text), first deliveries first
-- ARGV[6+c]           the same ids' 16-byte records, in one string (broker.redis.keys.inbox_records)
-- ARGV[7+c], [8+c]    optional: the lowest and highest id time (Unix ms) of the records, sent only
--                     when every id is a UUIDv7/v8 (broker.redis.keys.inbox_records_spanned)
-- Returns one status per id, in order (inbox_lease.lua): 0 = leased to the caller (run it),
-- 1 = already processed (a duplicate: ack it without running), 2 = being processed elsewhere.
-- When every status is 0 (the common case), the reply is c alone, an integer
-- (broker.redis.reading.claim_statuses expands it).
-- The read that takes new entries takes their leases itself (intake.lua); this call serves the
-- rest: backlogs read in large batches, claims, re-reads of a consumer's own pending entries.
--#include inbox_read
--#include inbox_lease
local c = tonumber(ARGV[5])
local out, fresh = inbox_lease(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[4], ARGV, 5, tonumber(ARGV[3]), c,
  ARGV[6 + c], tonumber(ARGV[7 + c]), tonumber(ARGV[8 + c]))
if fresh then return c end
return out
