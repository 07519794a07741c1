-- Stores one state of a job in the result backend (`pipeline.compat.results.OneTripStore._store_result`), as
-- Celery's Redis backend does in two round trips (a GET, then SETEX and PUBLISH in a MULTI), in one: a stored
-- SUCCESS is left alone (a redelivered job must not overwrite a final result), and so is a REVOKED (a cancelled
-- job stays cancelled: `pipeline.control.cancel`), else the encoded meta is written
-- (SETEX, or SET when it does not expire) and PUBLISHed on the key, for readers waiting on it.
-- Fenced: a state of a delivered job is stored only while the worker that runs it holds the job's lease (a worker
-- cut off for longer than its lease stores nothing for a job a peer took).
-- The `held` and `store` functions are written out, the same text, in every script that stores results (fetch.lua,
-- settle.lua). `store` deletes before it writes: at maxmemory Redis refuses a script whose first write may grow
-- memory, and lets it go on once it has written one that frees memory (so a result is stored on a full Redis).
-- KEYS[1] the task's key, KEYS[2] pipeline:lease (delivery tag -> owner).
-- ARGV[1] the encoded meta, ARGV[2] its expiry in seconds (0: none), ARGV[3] the job's delivery tag ('': not a
-- leased delivery, stored unfenced), ARGV[4] the owner that must hold it.
-- Returns 1 when stored, 0 when a SUCCESS or REVOKED was already there, -1 when fenced (nothing written either way).

-- held(lease, tag, owner): whether the result of delivery `tag` may be stored by `owner`.
local function held(lease, tag, owner)
  return tag == '' or redis.call('HGET', lease, tag) == owner
end

-- store(key, value, expires): the result backend's write, leaving a stored SUCCESS or REVOKED (cancelled) alone.
local function store(key, value, expires)
  local current = redis.call('GET', key)
  if current then
    local ok, meta = pcall(cjson.decode, current)
    if ok and type(meta) == 'table' and (meta['status'] == 'SUCCESS' or meta['status'] == 'REVOKED') then
      return 0
    end
  end
  redis.call('DEL', key)
  if tonumber(expires) > 0 then
    redis.call('SETEX', key, expires, value)
  else
    redis.call('SET', key, value)
  end
  redis.call('PUBLISH', key, value)
  return 1
end

if not held(KEYS[2], ARGV[3], ARGV[4]) then return -1 end
return store(KEYS[1], ARGV[1], ARGV[2])
