-- Renew a worker's leases: move each delivery's expiry in the index forward while this worker still owns it.
-- KEYS[1] unacked_index (tag -> lease expiry), KEYS[2] pipeline:lease (tag -> owner).
-- ARGV[1] the owner (the worker's incarnation id), ARGV[2] the new expiry (seconds since the epoch),
-- ARGV[3..] the delivery tags it holds.
-- Returns the tags this owner no longer holds (lost: a sweep gave them to a peer, or they were settled).
local lost = {}
for i = 3, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[2], tag) == ARGV[1] then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[2], tag)
  else
    lost[#lost + 1] = tag
  end
end
return lost
