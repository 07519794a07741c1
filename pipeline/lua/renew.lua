-- Renew a worker's leases: move each delivery's expiry in the index forward while this worker still owns it. The
-- expiry is Redis's clock (TIME) plus the lease, so a worker whose own clock is off neither loses its jobs nor
-- takes a peer's: every lease is written and judged (the sweep) on the one clock. The expiry is rounded up to the
-- whole second (a lease never shorter than granted, at most a second longer): a whole number is kept as an integer
-- in a small sorted set (a listpack, up to zset-max-listpack-entries), which a ZADD walks comparing scores, and a
-- fraction is kept as text, parsed again at each step (3-6x the CPU per ZADD at 20-127 entries: docs/benchmarks.md).
-- KEYS[1] unacked_index (tag -> lease expiry, Redis's clock), KEYS[2] pipeline:lease (tag -> owner).
-- ARGV[1] the owner (the worker's incarnation id), ARGV[2] the lease (seconds), ARGV[3..] the delivery tags it holds.
-- Returns the tags this owner no longer holds (lost: a sweep gave them to a peer, or they were settled).
-- Runs at maxmemory: each entry is removed before it is added again (a first write that frees memory).
local function renew(KEYS, ARGV)
  local t = redis.call('TIME')
  local expiry = math.ceil(tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]))
  local lost = {}
  for i = 3, #ARGV do
    local tag = ARGV[i]
    if redis.call('HGET', KEYS[2], tag) == ARGV[1] then
      redis.call('ZREM', KEYS[1], tag)
      redis.call('ZADD', KEYS[1], expiry, tag)
    else
      lost[#lost + 1] = tag
    end
  end
  return lost
end

return renew(KEYS, ARGV)
