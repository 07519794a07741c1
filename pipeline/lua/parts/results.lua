-- Part: storing a job's result in the result backend, fenced by its lease (store.lua, settle.lua, fetch.lua,
-- flow_advance.lua). `store` deletes before it writes: at maxmemory Redis refuses a script whose first write may grow
-- memory, and lets it go on once it has written one that frees memory (so a result is stored on a full Redis).

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
