-- Put one delivery back on its queue and clear its records (on a Redis Cluster: one queue's keys, one slot), as the
-- single-Redis transport's WATCHed restore does (`pipeline.delivery.transport.QoS.restore_tag`): only while its
-- record is still the one the caller read, and either held by the given owner (the holder's requeue, its shutdown)
-- or, for a sweep, with its lease expired by Redis's clock. The delivery count stays (the tag is in the message).
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] the lease owners, KEYS[4] the list to push it on, KEYS[5] the
-- queue's wake-up markers.
-- ARGV[1] the tag, ARGV[2] its record as read, ARGV[3] the element to push back, ARGV[4] the owner that must hold it
-- ('' for a sweep: its lease must have expired), ARGV[5] '1' to push it at the tail (LPUSH), else at the head.
-- Returns 1 when restored, else 0. Runs at maxmemory: the index's ZREM (a write that frees memory) comes first.
local function restore(KEYS, ARGV)
  local tag = ARGV[1]
  if redis.call('HGET', KEYS[1], tag) ~= ARGV[2] then return 0 end
  if ARGV[4] ~= '' then
    if redis.call('HGET', KEYS[3], tag) ~= ARGV[4] then return 0 end
  else
    local score = redis.call('ZSCORE', KEYS[2], tag)
    local t = redis.call('TIME')
    if score and tonumber(score) > tonumber(t[1]) + tonumber(t[2]) / 1000000 then return 0 end
  end
  redis.call('ZREM', KEYS[2], tag)
  redis.call('HDEL', KEYS[1], tag)
  redis.call('HDEL', KEYS[3], tag)
  redis.call(ARGV[5] == '1' and 'LPUSH' or 'RPUSH', KEYS[4], ARGV[3])
  redis.call('LPUSH', KEYS[5], '1')
  redis.call('LTRIM', KEYS[5], 0, 15)
  return 1
end

return restore(KEYS, ARGV)
