-- A flow step's job starts (`pipeline.flows.steps`): what it needs to know, in one call. Records the job as the one
-- running the node (a dead-letter replay runs it under a new id) and takes the node off the flow's failed set.
-- The keys are `flow_advance.lua`'s. KEYS[1] M (`pipeline:flow:{<id>}`).
-- ARGV[1] the node, ARGV[2] the job's id, ARGV[3] '1' to return the flow's input, ARGV[4..] the steps whose results
-- the node's payload is built from.
-- Returns {the flow's state (nil: no such flow), the node's result if it was recorded before (else nil), the input
-- (if asked, else nil), then per step of ARGV[4..]: -1 and its result for a plain step, or a fan-out step's item
-- count n and its n items' results in order (nil for one not recorded)}. A cancelled flow's step gets only the state.
local function flow_begin(KEYS, ARGV)
  local M = KEYS[1]
  local state = redis.call('HGET', M, 'state')
  if not state then return {false} end
  local node = ARGV[1]
  local result = redis.call('HGET', M .. ':results', node)
  if state == 'cancelled' and not result then return {state} end
  redis.call('HSET', M .. ':tasks', node, ARGV[2])
  redis.call('SREM', M .. ':failed', node)
  local out = {state, result or false, ARGV[3] == '1' and redis.call('HGET', M, 'input') or false}
  for i = 4, #ARGV do
    local step = ARGV[i]
    local n = redis.call('HGET', M, 'n:' .. step)
    if n then
      out[#out + 1] = tonumber(n)
      for j = 0, tonumber(n) - 1 do
        out[#out + 1] = redis.call('HGET', M .. ':results', step .. '[' .. j .. ']') or false
      end
    else
      out[#out + 1] = -1
      out[#out + 1] = redis.call('HGET', M .. ':results', step) or false
    end
  end
  return out
end

return flow_begin(KEYS, ARGV)
