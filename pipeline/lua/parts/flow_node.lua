-- Part: a flow's node recorded and its flow finished (flow_advance.lua, and fetch.lua, which records a solo
-- worker's fan-out items with their acknowledgements). M is the flow's hash, `pipeline:flow:{<id>}` (the layout is
-- at the top of flow_advance.lua).

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
