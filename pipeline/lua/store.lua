-- Stores one state of a job in the result backend (`pipeline.compat.results.OneTripStore._store_result`), as
-- Celery's Redis backend does in two round trips (a GET, then SETEX and PUBLISH in a MULTI), in one: a stored
-- SUCCESS is left alone (a redelivered job must not overwrite a final result), and so is a REVOKED (a cancelled
-- job stays cancelled: `pipeline.control.cancel`), else the encoded meta is written
-- (SETEX, or SET when it does not expire) and PUBLISHed on the key, for readers waiting on it.
-- Fenced: a state of a delivered job is stored only while the worker that runs it holds the job's lease (a worker
-- cut off for longer than its lease stores nothing for a job a peer took).
--- @include "results"

-- store_result(KEYS, ARGV):
-- KEYS[1] the task's key, KEYS[2] pipeline:lease (delivery tag -> owner).
-- ARGV[1] the encoded meta, ARGV[2] its expiry in seconds (0: none), ARGV[3] the job's delivery tag ('': not a
-- leased delivery, stored unfenced), ARGV[4] the owner that must hold it.
-- Returns 1 when stored, 0 when a SUCCESS or REVOKED was already there, -1 when fenced (nothing written either way).
local function store_result(KEYS, ARGV)
  if not held(KEYS[2], ARGV[3], ARGV[4]) then return -1 end
  return store(KEYS[1], ARGV[1], ARGV[2])
end

return store_result(KEYS, ARGV)
