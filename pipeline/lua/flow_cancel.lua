-- Cancels a running flow (`pipeline.control.flows.cancel_flow`): its state becomes 'cancelled', so no step of it is
-- queued any more (`flow_advance.lua` queues nothing for a flow that is not running, and `flow_begin.lua` tells a
-- step that starts not to run). The keys are `flow_advance.lua`'s.
-- KEYS[1] M (`pipeline:flow:{<id>}`). ARGV[1] now.
-- Returns the state before the call (nil: no such flow); only a 'running' flow is changed.
local function flow_cancel(KEYS, ARGV)
  local state = redis.call('HGET', KEYS[1], 'state')
  if state == 'running' then redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished', ARGV[1]) end
  return state
end

return flow_cancel(KEYS, ARGV)
