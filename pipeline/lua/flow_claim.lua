-- A flow's own call on a Redis Cluster (`pipeline.flows.handoff`): what flow_advance.lua does in the flow's slot
-- only. It creates the flow (node '') or records a node's result once, and claims the steps to queue (each once: the
-- HSETNX of its `on:` field) with their nodes' job ids, but queues nothing: a step's queue lives in another slot, on
-- another master maybe. The client then enqueues each claimed step's jobs on its queue under an idempotency key
-- named by the flow and the step, so a repeated hand-off never queues a step twice; a hand-off cut short between
-- this call and that enqueue is finished by the reconciler (`pipeline.flows.reconcile`). The flows index, the start's
-- idempotency key and the job's result are single keys, written by the client. The flow's keys are flow_advance.lua's
-- (its layout is at its top); `create`, `claim`, `record` and `finish` are its parts (parts/flow_node.lua).
--- @include "flow_node"

-- flow_claim(KEYS, ARGV): KEYS[1] M (`pipeline:flow:{<id>}`).
-- ARGV[1] node ('' to create), ARGV[2] its result (creating: the input), ARGV[3] the node's job id, ARGV[4] now,
-- ARGV[5] ttl (s) of the flow's keys, ARGV[6] the node's step, ARGV[7] '1' when the node is a fan-out item, ARGV[8]
-- the flow id, ARGV[9] its name, ARGV[10] its number of steps, ARGV[11] w, ARGV[12] m, then w pairs (step, a step it
-- waits on) (creating), then m candidates (creating: the first steps; else the node's step's children), each as: its
-- step, its node count k, '1' if a fan-out step, then k nodes and k job ids.
-- Returns {1 when this call recorded the node or created the flow (else 0: recorded before, the flow exists already,
-- or no such flow), the flow's state ('' for no such flow), 1 when the node's step is complete, when the node's step
-- was queued if this call recorded its last node (else ''), then the steps it claimed}.
local function flow_claim(KEYS, ARGV)
  local M = KEYS[1]
  local node, value, job, now, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
  local step, item = ARGV[6], ARGV[7] == '1'
  local w, m = tonumber(ARGV[11]), tonumber(ARGV[12])
  local at = 13
  local recorded, complete, since = 1, true, ''
  local state
  if node == '' then
    if redis.call('EXISTS', M) == 1 then return {0, redis.call('HGET', M, 'state'), 0, ''} end
    state = 'running'
    create(M, ARGV[9], value, now, ARGV[10], ttl, ARGV, at, w)
  else
    state = redis.call('HGET', M, 'state')
    if not state then return {0, '', 0, ''} end
    recorded, complete, since = record(M, node, value, job, step, item)
  end
  at = at + 2 * w
  local claimed = {}
  for _ = 1, m do
    local name, k, fan = ARGV[at], tonumber(ARGV[at + 1]), ARGV[at + 2] == '1'
    if claim(M, state, complete, node, step, name, k, fan, now) then
      for i = at + 3, at + 2 + k do redis.call('HSET', M .. ':tasks', ARGV[i], ARGV[i + k]) end
      claimed[#claimed + 1] = name
    end
    at = at + 3 + 2 * k
  end
  state = finish(M, state, now, ttl)
  local reply = {recorded, state, complete and 1 or 0, since}
  for _, name in ipairs(claimed) do reply[#reply + 1] = name end
  return reply
end

return flow_claim(KEYS, ARGV)
