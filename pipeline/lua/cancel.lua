-- Cancels a job (`pipeline.control.cancel`): its parked entry, if it is a delayed job, is deleted (it never reaches
-- a queue), its tombstone is written (a worker's fetch drops the job's message unrun: fetch.lua), and its id is
-- PUBLISHed on the cancel channel (a worker holding the job stops it: `pipeline.runtime.cancels`).
-- KEYS[1] the tombstone (pipeline:cancel:<id>), KEYS[2] the parked jobs' due-time index (pipeline:delayed),
-- KEYS[3] their messages, KEYS[4] their queues: on a Redis Cluster the job's queue's, all in its slot.
-- ARGV[1] the task id, ARGV[2] the tombstone's TTL (seconds), ARGV[3] the cancel channel ('' to publish nothing).
-- Returns 1 when a parked entry was deleted, else 0. At maxmemory the tombstone's SET may be refused (an OOM
-- error, nothing written): the caller reports it; a parked entry is deleted first, which frees memory.
local function cancel(KEYS, ARGV)
  local parked = redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
  redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[2]))
  if ARGV[3] ~= '' then
    redis.call('PUBLISH', ARGV[3], ARGV[1])
  end
  return parked
end

return cancel(KEYS, ARGV)
