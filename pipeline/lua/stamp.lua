-- Stamps a result's owner on a Redis Cluster (`pipeline.delivery.stamps`): the worker that took a delivery of a job
-- names itself beside the job's result, in the result's slot, before the job runs, so store.lua refuses a state of
-- the job from a worker that held an earlier delivery of it (its lease lapsed and a peer took the job). Deliveries
-- of one tag are ordered by their delivery count (`pipeline:{<q>}:deliveries`, counted by the fetch): a stamp never
-- replaces a later delivery's, so a worker that was frozen between its fetch and its stamp cannot take the result
-- back from the peer that took the job after it.

-- stamp(KEYS, ARGV):
-- KEYS[1] the result's owner stamp (`pipeline:owner:{<task key>}`: delivery tag -> owner, '<tag>#' -> its count).
-- ARGV[1] the delivery tag, ARGV[2] the owner, ARGV[3] the delivery count of this delivery, ARGV[4] the stamp's TTL
-- in seconds (the result's).
-- Returns 1 when stamped, 0 when a later delivery of the tag stamped already (this delivery is not the job's now).
local function stamp(KEYS, ARGV)
  local count = redis.call('HGET', KEYS[1], ARGV[1] .. '#')
  if count and tonumber(count) > tonumber(ARGV[3]) then return 0 end
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[1] .. '#', ARGV[3])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return 1
end

return stamp(KEYS, ARGV)
