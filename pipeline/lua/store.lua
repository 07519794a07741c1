-- Stores one state of a job in the result backend (`pipeline.compat.results.OneTripStore._store_result`), as
-- Celery's Redis backend does in two round trips (a GET, then SETEX and PUBLISH in a MULTI), in one: a stored
-- SUCCESS is left alone (a redelivered job must not overwrite a final result), and so is a REVOKED (a cancelled
-- job stays cancelled: `pipeline.control.cancel`), else the encoded meta is written
-- (SETEX, or SET when it does not expire) and PUBLISHed on the key, for readers waiting on it. A SUCCESS written
-- deletes the job's accepted-job record (and on a Redis Cluster the result's owner stamp), declared in KEYS.
-- Fenced: a state of a delivered job is stored only while the worker that runs it holds the job's lease (a worker
-- cut off for longer than its lease stores nothing for a job a peer took). On a Redis Cluster the lease lives in
-- its queue's slot, elsewhere: the result's owner stamp, in the result's slot, names the worker that last took the
-- delivery (`pipeline.delivery.stamps`), and a state of a worker it does not name is refused.
--- @include "results"

-- store_result(KEYS, ARGV):
-- KEYS[1] the task's key, KEYS[2] pipeline:lease (delivery tag -> owner), or with ARGV[5] = '1' the result's owner
-- stamp (`pipeline:owner:{<task key>}`, delivery tag -> owner), KEYS[3..] the keys a SUCCESS written deletes (the
-- job's record `pipeline:job:<id>`, on a cluster `pipeline:job:{<task key>}`; the owner stamp).
-- ARGV[1] the encoded meta, ARGV[2] its expiry in seconds (0: none), ARGV[3] the job's delivery tag ('': not a
-- leased delivery, stored unfenced), ARGV[4] the owner that must hold it, ARGV[5] '1' when KEYS[2] is an owner stamp
-- (a delivery no owner stamped yet is not fenced by it).
-- Returns 1 when stored, 0 when a SUCCESS or REVOKED was already there, -1 when fenced (nothing written either way).
local function store_result(KEYS, ARGV)
  local fence = ARGV[5] == '1' and unclaimed or held
  if not fence(KEYS[2], ARGV[3], ARGV[4]) then return -1 end
  return store(KEYS[1], ARGV[1], ARGV[2], {unpack(KEYS, 3)})
end

return store_result(KEYS, ARGV)
