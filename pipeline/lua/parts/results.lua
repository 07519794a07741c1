-- Part: storing a job's result in the result backend, fenced by its lease (store.lua, settle.lua, fetch.lua,
-- flow_advance.lua). `store` deletes before it writes: at maxmemory Redis refuses a script whose first write may grow
-- memory, and lets it go on once it has written one that frees memory (so a result is stored on a full Redis).

-- held(lease, tag, owner): whether the result of delivery `tag` may be stored by `owner`.
local function held(lease, tag, owner)
  return tag == '' or redis.call('HGET', lease, tag) == owner
end

-- unclaimed(stamp, tag, owner): whether the result of delivery `tag` may be stored by `owner`, by the result's owner
-- stamp on a Redis Cluster (`pipeline.delivery.stamps`): unless another owner took the delivery since.
local function unclaimed(stamp, tag, owner)
  if tag == '' then return true end
  local holder = redis.call('HGET', stamp, tag)
  return not holder or holder == owner
end

-- success(value): whether `value` is a SUCCESS meta as `pipeline.compat.results` encodes it (compact); another
-- encoding (a Celery outside the verified versions) leaves the job's record alone.
local function success(value)
  return string.sub(value, 1, 20) == '{"status":"SUCCESS",'
end

-- record_of(value): the accepted-job record (`pipeline:job:<id>`, JOB_RECORD_KEY) of a SUCCESS meta on a single
-- Redis, for the scripts that carry results without declaring it (settle.lua, fetch.lua, flow_advance.lua): the id
-- is the meta's last field ("task_id", as `pipeline.compat.results` encodes it, compact). store.lua declares it.
local function record_of(value)
  local id = string.match(value, ',"task_id":"([^"\\]+)"}$')
  return id and ('pipeline:job:' .. id)
end

-- store(key, value, expires, drop): the result backend's write, leaving a stored SUCCESS or REVOKED (cancelled)
-- alone; a SUCCESS written deletes the keys of `drop` (the job's record, which the result makes useless: status reads
-- its accepted time from the queue's recent-jobs index afterwards (`pipeline.records`); on a cluster also the
-- result's owner stamp). `drop` nil: the record named by the meta (`record_of`).
local function store(key, value, expires, drop)
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
  if success(value) then
    if drop == nil then drop = {record_of(value)} end
    for _, gone in ipairs(drop) do redis.call('DEL', gone) end
  end
  return 1
end

-- store_held(lease, owner, keys, key0, argv, arg0, n): n results, the r-th stored in keys[key0 + r] from the triple
-- argv[arg0 + 3r - 2 ..] (encoded meta, expiry in seconds (0: none), delivery tag ('': unfenced)), each only while
-- `owner` holds its delivery.
local function store_held(lease, owner, keys, key0, argv, arg0, n)
  for r = 1, n do
    local at = arg0 + 3 * (r - 1)
    if held(lease, argv[at + 3], owner) then
      store(keys[key0 + r], argv[at + 1], argv[at + 2])
    end
  end
end
