-- Stores one state of a job in the result backend (`pipeline.compat.results.OneTripStore._store_result`), as
-- Celery's Redis backend does in two round trips (a GET, then SETEX and PUBLISH in a MULTI), in one: a stored
-- SUCCESS is left alone (a redelivered job must not overwrite a final result), else the encoded meta is written
-- (SETEX, or SET when it does not expire) and PUBLISHed on the key, for readers waiting on it.
-- The `store` function is written out, the same text, in every script that stores results (fetch.lua, settle.lua).
-- KEYS[1] the task's key.
-- ARGV[1] the encoded meta, ARGV[2] its expiry in seconds (0: none).
-- Returns 1 when stored, 0 when a SUCCESS was already there (nothing written).

-- store(key, value, expires): the result backend's write, leaving a stored SUCCESS alone.
local function store(key, value, expires)
  local current = redis.call('GET', key)
  if current then
    local ok, meta = pcall(cjson.decode, current)
    if ok and type(meta) == 'table' and meta['status'] == 'SUCCESS' then return 0 end
  end
  if tonumber(expires) > 0 then
    redis.call('SETEX', key, expires, value)
  else
    redis.call('SET', key, value)
  end
  redis.call('PUBLISH', key, value)
  return 1
end

return store(KEYS[1], ARGV[1], ARGV[2])
