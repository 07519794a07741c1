-- Part of fetch.lua, included inside `fetch` (its helpers close over the fetch's locals): the fair groups of a queue
-- key (`pipeline.fairness.groups`; the keys under P are described at the top of fetch.lua). Uses fetch's KEYS, cap, P.

-- running(g): how many of group g's jobs hold a lease now (tags whose lease ended, by any path, are dropped).
local function running(g)
  local key = P .. 'leases:' .. g
  local n = 0
  for _, tag in ipairs(redis.call('SMEMBERS', key)) do
    if redis.call('HEXISTS', KEYS[3], tag) == 1 then n = n + 1 else redis.call('SREM', key, tag) end
  end
  return n
end

-- ready(key, g): group g of `key` has jobs: back in the ring, or capped while g runs `cap` jobs.
local function ready(key, g)
  local state = P .. 'state:' .. key
  if redis.call('LLEN', P .. 'jobs:' .. key .. ':' .. g) == 0 then
    redis.call('HDEL', state, g)
  elseif cap > 0 and running(g) >= cap then
    if redis.call('HGET', state, g) ~= 'c' then
      redis.call('HSET', state, g, 'c')
      redis.call('LPUSH', P .. 'capped:' .. key, g)
    end
  else
    redis.call('HSET', state, g, 'r')
    redis.call('LPUSH', P .. 'ring:' .. key, g)
  end
end

-- regroup(key, item, g): a message of group g popped from the plain list goes to its group, at the head.
local function regroup(key, item, g)
  redis.call('RPUSH', P .. 'jobs:' .. key .. ':' .. g, item)
  redis.call('HINCRBY', P .. 'count', key, 1)
  if not redis.call('HGET', P .. 'state:' .. key, g) then ready(key, g) end
end

-- group_of(item): the group a message envelope names in its headers, or nil.
local function group_of(item)
  if not string.find(item, '"pipeline_group"', 1, true) then return nil end
  local ok, msg = pcall(cjson.decode, item)
  if ok and type(msg) == 'table' and type(msg.headers) == 'table' then
    local g = msg.headers.pipeline_group
    if type(g) == 'string' and g ~= '' then return g end
  end
  return nil
end

-- Capped groups of `key` whose jobs ended are put back in the ring: a few per fetch, oldest first.
local function uncap(key)
  local capped = P .. 'capped:' .. key
  for _ = 1, math.min(4, redis.call('LLEN', capped)) do
    local g = redis.call('RPOP', capped)
    redis.call('HDEL', P .. 'state:' .. key, g)
    ready(key, g)
  end
end

-- A popped group's next job (nil when the ring is empty, or when the group already runs `cap` jobs), and the
-- group, which goes on to its next state. The cap is checked here, when a job is taken, not only when a group
-- re-enters the ring: a group whose list emptied while its jobs still run leaves the state hash, and the next
-- enqueue (enqueue.lua, which does not know the worker's cap) puts it straight back in the ring.
local function from_group(key)
  local g = redis.call('RPOP', P .. 'ring:' .. key)
  if not g then return nil end
  if cap > 0 and running(g) >= cap then return nil, g end
  local item = redis.call('RPOP', P .. 'jobs:' .. key .. ':' .. g)
  if item then redis.call('HINCRBY', P .. 'count', key, -1) end
  return item, g
end
