-- reply_send.lua: store one reply on its requester's reply stream, only if that stream still exists.
--
-- KEYS[1]  the reply stream (created by reply_open.lua, with an expiry)
-- ARGV     the reply envelope's field/value list (broker.codec.encode_fields)
-- Returns 1 when stored, 0 when the stream is gone (its requester closed or died: the reply is
-- dropped rather than left behind for ever without an expiry).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', 100000, '*', unpack(ARGV))
return 1
