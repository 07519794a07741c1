-- Part: a flow created, its steps claimed, its node recorded and its flow finished (flow_advance.lua and
-- flow_claim.lua; fetch.lua, which records a solo worker's fan-out items with their acknowledgements, uses `record`
-- and `finish`). M is the flow's hash, `pipeline:flow:{<id>}` (the layout is at the top of flow_advance.lua).

-- record(M, node, value, job, step, item): record a node's result, the first time only (HSETNX); returns 1 when
-- this call recorded it (else 0), whether its step is complete (all its nodes recorded), and when the step was
-- queued (its `on:` field) if this call recorded its last node (else '').
local function record(M, node, value, job, step, item)
  local recorded = redis.call('HSETNX', M .. ':results', node, value)
  local complete, since = true, ''
  if recorded == 1 then
    redis.call('HSET', M .. ':tasks', node, job)
    redis.call('SREM', M .. ':failed', node)
    redis.call('HINCRBY', M, 'done', 1)
    if item then complete = redis.call('HINCRBY', M, 'more:' .. step, -1) == 0 end
    if complete then since = redis.call('HGET', M, 'on:' .. step) or '' end
  elseif item then
    complete = redis.call('HGET', M, 'more:' .. step) == '0'
  end
  return recorded, complete, since
end

-- finish(M, state, now, ttl): a running flow whose steps are all queued and whose queued nodes are all recorded
-- succeeds (at `now`); every key of the flow gets `ttl` seconds more to live. Returns the flow's state.
local function finish(M, state, now, ttl)
  if state == 'running' and tonumber(redis.call('HGET', M, 'left')) == 0
      and redis.call('HGET', M, 'done') == redis.call('HGET', M, 'total') then
    state = 'succeeded'
    redis.call('HSET', M, 'state', state, 'finished', now)
  end
  for _, suffix in ipairs({'', ':results', ':tasks', ':failed'}) do redis.call('EXPIRE', M .. suffix, ttl) end
  return state
end

-- create(M, name, input, now, steps, ttl, pairs, at, w): a new running flow's hash, and the wait set of each step
-- after others (`pairs[at..]`: w pairs (step, a step it waits on)).
local function create(M, name, input, now, steps, ttl, pairs, at, w)
  redis.call('HSET', M, 'name', name, 'input', input, 'created', now, 'state', 'running', 'left', steps,
    'total', 0, 'done', 0)
  for i = at, at + 2 * w - 1, 2 do
    redis.call('SADD', M .. ':wait:' .. pairs[i], pairs[i + 1])
    redis.call('EXPIRE', M .. ':wait:' .. pairs[i], ttl)
  end
end

-- claim(M, state, complete, node, step, name, k, fan, now): step `name` (k nodes, a fan-out when `fan`) is to be
-- queued by this call: the flow runs, the node's step is complete, `name` waits on nothing else any more (SREM of
-- the node's step from its wait set; creating, node '', a first step waits on nothing) and its `on:` field was not
-- set yet (HSETNX: exactly once). Counts the claimed step's nodes in the flow; returns whether it claimed it.
local function claim(M, state, complete, node, step, name, k, fan, now)
  local go = state == 'running' and complete
  if go and node ~= '' then
    local wait = M .. ':wait:' .. name
    redis.call('SREM', wait, step)
    go = redis.call('SCARD', wait) == 0
  end
  if not (go and redis.call('HSETNX', M, 'on:' .. name, now) == 1) then return false end
  redis.call('HINCRBY', M, 'left', -1)
  redis.call('HINCRBY', M, 'total', k)
  if fan then redis.call('HSET', M, 'n:' .. name, k, 'more:' .. name, k) end
  return true
end
