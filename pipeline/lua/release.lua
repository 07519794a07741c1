-- Give up leases: a delivery the worker dropped without running it is marked expired, so the next sweep puts it
-- back on its queue.
-- KEYS[1] unacked_index, KEYS[2] pipeline:lease.
-- ARGV[1] the owner, ARGV[2..] the delivery tags to give up (only those this owner still holds).
-- Returns 0. Runs at maxmemory: the lease's HDEL (a write that frees memory) comes first.
local function release(KEYS, ARGV)
  for i = 2, #ARGV do
    local tag = ARGV[i]
    if redis.call('HGET', KEYS[2], tag) == ARGV[1] then
      redis.call('HDEL', KEYS[2], tag)
      redis.call('ZADD', KEYS[1], 'XX', 0, tag)
    end
  end
  return 0
end

return release(KEYS, ARGV)
