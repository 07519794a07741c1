-- Advances a flow (`pipeline.flows`): records a node's result once and queues the steps that waited on its step last;
-- with node '', creates the flow and queues its first steps. A node's result is recorded by the first call only
-- (HSETNX); a later call for it (a redelivered or replayed job, or the call that brings the next steps' jobs after a
-- fan-out item completed its step) records nothing and may still queue what its complete step lets run. A step is
-- queued exactly once (SREM on its wait set, then HSETNX on its `on:` field), however many workers finish its
-- parents at once and however often a call is repeated. The candidates are offered by the caller: for a fan-out
-- item it offers none first (most items do not complete their step), and calls again with them when the reply says
-- the step is complete.
-- A node is a step's name, or `<step>[<i>]` for item i of a fan-out step. The flow's keys share one hash tag, its id;
-- M = KEYS[1] = `pipeline:flow:{<id>}`:
--   M          HASH  name, input (JSON), created, finished (epoch s), state ('running', 'succeeded', 'cancelled'),
--                    left (steps not queued yet), total (nodes queued), done (nodes succeeded), n:<step> (a fan-out
--                    step's item count), more:<step> (its items not done yet), on:<step> (when the step was queued)
--   M:results  HASH  node -> its result (JSON)
--   M:tasks    HASH  node -> the id of the job that runs it (the latest: a dead-letter replay gives a new id)
--   M:failed   SET   nodes whose job was dead-lettered and not replayed since (`pipeline.flows.record.failed`)
--   M:wait:<s> SET   the steps step s still waits on; the call that removes the last one queues s
-- Every key of the flow gets ARGV[5] seconds more to live on each call.
-- The call that records a node may also store its job's SUCCESS in the result backend (ARGV[17] not ''), as
-- store.lua does and fenced the same way (stored only while ARGV[20] holds the job's lease ARGV[19]): the job's
-- result costs no call of its own (`pipeline.flows.steps`). The node is recorded either way, as without a result.
-- `held` and `store` are store.lua's (parts/results.lua); `create` and `claim` (parts/flow_node.lua) are shared with
-- flow_claim.lua (a flow's own call on a Redis Cluster), `record` and `finish` with it and with fetch.lua, which
-- records a solo worker's fan-out items with their acknowledgements (`pipeline.delivery.acks`). The result is stored
-- after the node is recorded: at maxmemory the call is refused as a whole (its first write may grow memory), as it
-- was without a result, and the job retries.
--- @include "results"
--- @include "flow_node"

-- flow_advance(KEYS, ARGV):
-- KEYS[1] M, KEYS[2] the flows index (ZSET id -> created), then 3 per candidate step (below): its queue list, that
-- queue's wake-up marker list (`pipeline.queues.wake`), its recent-jobs index; last, when creating with an
-- idempotency key, the key's holder (`pipeline:flow-start:<name>:<key>`, STRING: the id of the flow that claimed it),
-- or, when storing the job's result, its task key and pipeline:lease.
-- ARGV[1] node ('' to create), ARGV[2] its result (creating: the input), ARGV[3] the node's job id, ARGV[4] now,
-- ARGV[5] ttl (s) of the flow's keys and of the queued jobs' records, ARGV[6] the job record key prefix, ARGV[7] the
-- recent-jobs index size, ARGV[8] the node's step, ARGV[9] '1' when the node is a fan-out item, ARGV[10] the flow id,
-- ARGV[11] its name, ARGV[12] its number of steps, ARGV[13] w, ARGV[14] m, ARGV[15] the flows index size, ARGV[16]
-- the idempotency key holder's ttl (s) when creating with a key (else ''), ARGV[17] the job's encoded result meta to
-- store ('' for none), ARGV[18] its expiry in seconds (0: none), ARGV[19] the job's delivery tag ('': stored
-- unfenced), ARGV[20] the lease owner that must hold it, then w
-- pairs (step, a step it waits on) (creating), then m candidates: steps that may be queued now (creating: the first
-- steps; else the node's step's children), each as: its step, its node count k, '1' if a fan-out step, its jobs'
-- record, an event channel ('' for none), then k nodes, k job ids, k messages, and k events when there is a channel.
-- Returns {1 when this call recorded the node or created the flow (else 0: recorded before, or no such flow), the
-- flow's state ('' for no such flow), 1 when the node's step is complete (all its nodes recorded), when the node's
-- step was queued (its `on:` field) if this call recorded its last node (else ''), '' (creating with an idempotency
-- key an earlier start holds: that flow's id, and nothing is written), what became of the job's result (1 stored, 0 a
-- SUCCESS or REVOKED was there, -1 fenced; '' none given, or no such flow), then the steps it queued}.
local function flow_advance(KEYS, ARGV)
  local M = KEYS[1]
  local node, value, job, now, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
  local prefix, keep, step, item = ARGV[6], tonumber(ARGV[7]), ARGV[8], ARGV[9] == '1'
  local w, m = tonumber(ARGV[13]), tonumber(ARGV[14])
  local at = 21
  local keyed = ARGV[16] ~= ''
  local complete = true
  local since = ''
  local recorded = 1
  local stored = ''
  local state
  if node == '' then
    if keyed then
      local first = redis.call('GET', KEYS[#KEYS])
      if first then return {0, '', 0, '', first, ''} end
    end
    if redis.call('EXISTS', M) == 1 then return {0, redis.call('HGET', M, 'state'), 0, '', '', ''} end
    if keyed then redis.call('SET', KEYS[#KEYS], ARGV[10], 'EX', ARGV[16]) end
    state = 'running'
    create(M, ARGV[11], value, now, ARGV[12], ttl, ARGV, at, w)
    redis.call('ZADD', KEYS[2], now, ARGV[10])
    redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[15]) - 1)
  else
    state = redis.call('HGET', M, 'state')
    if not state then return {0, '', 0, '', '', ''} end
    recorded, complete, since = record(M, node, value, job, step, item)
    if ARGV[17] ~= '' then
      stored = -1
      if held(KEYS[#KEYS], ARGV[19], ARGV[20]) then stored = store(KEYS[#KEYS - 1], ARGV[17], ARGV[18]) end
    end
  end
  at = at + 2 * w
  local queued = {}
  for c = 1, m do
    local name, k, fan, record, channel = ARGV[at], tonumber(ARGV[at + 1]), ARGV[at + 2] == '1', ARGV[at + 3], ARGV[at + 4]
    local first = at + 5
    local events = channel ~= '' and k or 0
    if claim(M, state, complete, node, step, name, k, fan, now) then
      local list, marker, recent = KEYS[3 * c], KEYS[3 * c + 1], KEYS[3 * c + 2]
      for i = 0, k - 1 do
        local id = ARGV[first + k + i]
        redis.call('HSET', M .. ':tasks', ARGV[first + i], id)
        redis.call('SET', prefix .. id, record, 'EX', ttl)
        redis.call('ZADD', recent, now, id)
        redis.call('LPUSH', list, ARGV[first + 2 * k + i])
        if events > 0 then redis.call('PUBLISH', channel, ARGV[first + 3 * k + i]) end
      end
      redis.call('ZREMRANGEBYRANK', recent, 0, -keep - 1)
      for _ = 1, math.min(k, 16) do redis.call('LPUSH', marker, '1') end
      redis.call('LTRIM', marker, 0, 15)
      queued[#queued + 1] = name
    end
    at = first + 3 * k + events
  end
  state = finish(M, state, now, ttl)
  local reply = {recorded, state, complete and 1 or 0, since, '', stored}
  for _, name in ipairs(queued) do reply[#reply + 1] = name end
  return reply
end

return flow_advance(KEYS, ARGV)
