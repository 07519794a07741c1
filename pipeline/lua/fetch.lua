-- The worker's fetch: settle what the last batch left (results, then fenced acknowledgements, as settle.lua, then
-- fan-out items' nodes of flows), then
-- pop up to ARGV[9] messages over the consumed keys in kombu's order and record each as held by this worker, in
-- the same step: kombu's unacked record and index entry (as kombu's QoS.append writes them), the lease owner, the
-- delivery count and a bounded delivery history. An element of a queue consumed without acknowledgement (Celery's
-- control replies, `reply.celery.pidbox`) is popped and returned, not recorded: nothing will acknowledge it.
-- The lease expiry (the index score) is Redis's clock (TIME) plus the lease: a sweep judges every lease on it.
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries, KEYS[5..] the queue
-- keys in kombu's order (priority steps, then queues), then the task key of each result to store (n of them), then
-- the hash of the flow of each node to record (r of them: `pipeline:flow:{<id>}`), then last the set of paused queue
-- names (`pipeline:paused`).
-- ARGV[1] the lease (seconds), ARGV[2] the owner, ARGV[3] the worker's node name, ARGV[4] a fresh tag prefix for
-- elements that are not message envelopes, ARGV[5] the delivery history's key prefix, ARGV[6] its length,
-- ARGV[7] its TTL (seconds), ARGV[8] one character per queue key, '1' where the key is consumed without
-- acknowledgement, ARGV[9] how many elements to take at most, ARGV[10] the number of results n, ARGV[11]
-- GROUP_CONCURRENCY (0: no cap), ARGV[12] the groups' key prefix P, ARGV[13] the number of nodes r, ARGV[14] the
-- cluster-wide limits of the worker's tasks as JSON ({task: [interval ms, tolerance ms, 1 if keyed, key base]}, or
-- '' for none), ARGV[15..14+3n] n triples (encoded result meta, expiry, the job's delivery tag or ''), then r sextuples (a fan-out
-- item's node, its result (JSON), its job's id, its step, now (epoch s), the flow keys' ttl (s)), then the tags to
-- acknowledge.
-- A node is recorded as flow_advance.lua records a fan-out item offering no step (the `record` and `finish` functions
-- are its own, written out), after the results and acknowledgements: a solo worker's item costs no call of its own
-- (`pipeline.delivery.acks`). The caller acknowledges an item's job in a later call, once it has seen the answer
-- (and queued what the item's complete step lets run).
-- Groups (`pipeline.fairness.groups`): for a queue key K, P..'ring:'..K lists the groups with jobs ready (each
-- once), P..'jobs:'..K..':'..G holds group G's jobs, P..'state:'..K maps a group to 'r' (in the ring) or 'c'
-- (capped), P..'capped:'..K lists the capped groups, P..'leases:'..G the delivery tags of G's running jobs (checked
-- against pipeline:lease, so a lease that ended by any path frees its slot), P..'turn' whose turn it is per key
-- (plain jobs or groups), P..'count' how many grouped jobs wait per key. The cap is checked on every job taken from
-- a group (a group in the ring included: enqueue.lua rings a group without knowing the cap), and a job holds its
-- group's slot from this fetch until its lease ends. Within a key, jobs are taken round-robin over the groups, the
-- plain (ungrouped) jobs taking every other turn; a message with a group that reaches the plain list (a retry, a
-- restore, a delayed release, a foreign client) is moved to its group when popped.
-- Rate slots (`pipeline.scheduling.ratelimit`): a message envelope of a task named in ARGV[14], with no slot of its
-- own (no pipeline_rate_slot header: a deferred job asks with it when it runs), takes its slot here, as
-- rate_acquire.lua takes one without a carried slot, on the limiter's key: the key base, then ':' and its
-- pipeline_rate_key header for a keyed limit (a keyed task's message without that header takes none). Only keys
-- under the worker's own bases are written, whatever a message's headers say.
-- Returns {the tags whose acknowledgement was fenced}, {the consumed queues that are paused}, {4 fields per node, as
-- flow_advance.lua answers: 1 when this call recorded it, the flow's state ('' for no such flow), 1 when its step is
-- complete, when its step was queued if this call recorded the step's last node (else '')}, then 8 fields per
-- element, oldest first: key, tag (or ''), delivery count (0: not recorded), the element, its kind (0 a message
-- envelope, 1 not an envelope: dead-lettered by the worker, 2 not recorded: from a queue consumed without
-- acknowledgement, 3 a cancelled job's message: popped and acknowledged here, to be dropped unrun), then the limiter's
-- key of the rate slot it took, the wait before that slot and the slot on Redis's clock, in ms, as rate_acquire.lua
-- returns them ('', '', '' for none).
-- Runs at maxmemory: each step's first write frees memory (`store`'s DEL, an acknowledgement's ZREM, the RPOP), so
-- a full Redis is drained by its workers.

-- held(lease, tag, owner): whether the result of delivery `tag` may be stored by `owner`.
local function held(lease, tag, owner)
  return tag == '' or redis.call('HGET', lease, tag) == owner
end

-- store(key, value, expires): the result backend's write (store.lua), leaving a stored SUCCESS or REVOKED alone.
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

local nres = tonumber(ARGV[10])
local nnodes = tonumber(ARGV[13])
local first_result_key = #KEYS - nres - nnodes - 1
for r = 1, nres do
  local at = 14 + 3 * (r - 1)
  if held(KEYS[3], ARGV[at + 3], ARGV[2]) then
    store(KEYS[first_result_key + r], ARGV[at + 1], ARGV[at + 2])
  end
end

local fenced = {}
for i = 15 + 3 * nres + 6 * nnodes, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[3], tag) == ARGV[2] then
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[1], tag)
    redis.call('HDEL', KEYS[3], tag)
    redis.call('HDEL', KEYS[4], tag)
    redis.call('DEL', ARGV[5] .. tag)
  else
    fenced[#fenced + 1] = tag
  end
end

-- The nodes, after the writes that free memory (at maxmemory the script's first write must free some).
local answers = {}
for r = 1, nnodes do
  local at = 14 + 3 * nres + 6 * (r - 1)
  local M = KEYS[first_result_key + nres + r]
  local state = redis.call('HGET', M, 'state')
  if state then
    local recorded, complete, since = record(M, ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4], true)
    state = finish(M, state, ARGV[at + 5], tonumber(ARGV[at + 6]))
    for _, v in ipairs({recorded, state, complete and 1 or 0, since}) do answers[#answers + 1] = v end
  else
    for _, v in ipairs({0, '', 0, ''}) do answers[#answers + 1] = v end
  end
end

-- Paused queues (`pipeline.scheduling.pause`): no key of a queue named in the set is popped, its priority sub-keys
-- (`<queue>\x06\x16<n>`) included, so its jobs stay queued. The consumed queues found paused go back in the reply,
-- so the worker does not wait on a key it may not take from. Reads only; one SCARD when nothing is paused.
local skip, paused = {}, {}
local pause_key = KEYS[#KEYS]
if redis.call('SCARD', pause_key) > 0 then
  local seen = {}
  for i = 5, first_result_key do
    local queue = string.match(KEYS[i], '^(.*)\6\22%d+$') or KEYS[i]
    if seen[queue] == nil then
      seen[queue] = redis.call('SISMEMBER', pause_key, queue) == 1
      if seen[queue] then paused[#paused + 1] = queue end
    end
    skip[i] = seen[queue]
  end
end

local out = {fenced, paused, answers}
local want = tonumber(ARGV[9])
local taken = 0
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local expiry = now + tonumber(ARGV[1])
local stamp = string.format('%.3f', now)
local cap = tonumber(ARGV[11])
local P = ARGV[12]
local limits = ARGV[14] ~= '' and cjson.decode(ARGV[14]) or nil
local now_ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

-- slot(h): the rate slot a message with headers h takes here, and the wait before it (see above), or nil.
local function slot(h)
  local limit = limits and type(h.task) == 'string' and limits[h.task]
  if not limit or (h.pipeline_rate_slot ~= nil and h.pipeline_rate_slot ~= cjson.null) then return nil end
  local key = limit[4]
  if limit[3] == 1 then
    if type(h.pipeline_rate_key) ~= 'string' then return nil end
    key = key .. ':' .. h.pipeline_rate_key
  end
  local interval, tau = tonumber(limit[1]), tonumber(limit[2])
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now_ms then tat = now_ms end
  local start = tat - tau
  if start < now_ms then start = now_ms end
  local new_tat = tat + interval
  redis.call('SET', key, tostring(new_tat), 'PX', math.ceil(new_tat - now_ms + tau) + 1000)
  return key, tostring(start - now_ms), tostring(start)
end

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

-- take(key, item, untracked, g): record `item` popped from `key` as held by this worker (or pass an untracked
-- one on), append it to the reply; g: its group, or nil.
local function take(key, item, untracked, g)
  taken = taken + 1
  if untracked then
    out[#out + 1] = key
    out[#out + 1] = ''
    out[#out + 1] = 0
    out[#out + 1] = item
    out[#out + 1] = 2
    for _ = 1, 3 do out[#out + 1] = '' end
    return
  end
  local tag, record
  local ok, msg = pcall(cjson.decode, item)
  if ok and type(msg) == 'table' and type(msg.properties) == 'table' then
    local p = msg.properties
    local di = p.delivery_info
    if type(p.delivery_tag) == 'string' and type(di) == 'table'
        and di.exchange ~= nil and di.routing_key ~= nil then
      tag = p.delivery_tag
      record = '[' .. item .. ',' .. cjson.encode(di.exchange) .. ',' .. cjson.encode(di.routing_key) .. ']'
    end
  end
  local poison = 0
  if not tag then
    poison = 1
    tag = ARGV[4] .. taken
    record = '[' .. cjson.encode(item) .. ',"",' .. cjson.encode(key) .. ']'
  end
  redis.call('HSET', KEYS[1], tag, record)
  redis.call('ZADD', KEYS[2], expiry, tag)
  redis.call('HSET', KEYS[3], tag, ARGV[2])
  local n = redis.call('HINCRBY', KEYS[4], tag, 1)
  local history = ARGV[5] .. tag
  redis.call('RPUSH', history, '{"at":' .. stamp .. ',"worker":' .. cjson.encode(ARGV[3]) .. '}')
  redis.call('LTRIM', history, -tonumber(ARGV[6]), -1)
  redis.call('EXPIRE', history, tonumber(ARGV[7]))
  if g and cap > 0 then
    redis.call('SADD', P .. 'leases:' .. g, tag)
    redis.call('EXPIRE', P .. 'leases:' .. g, 7 * 86400)
  end
  out[#out + 1] = key
  out[#out + 1] = tag
  out[#out + 1] = n
  out[#out + 1] = item
  out[#out + 1] = poison
  for _ = 1, 3 do out[#out + 1] = '' end
  -- Cancelled (`pipeline cancel`: cancel.lua wrote the tombstone pipeline:cancel:<headers.id>, the prefix of
  -- CANCEL_KEY): acknowledged here, its records just written removed as settle.lua removes them, and returned
  -- as kind 3 for the worker to drop unrun (its group's slot is free again: its lease record is gone).
  if poison == 0 and type(msg.headers) == 'table' and type(msg.headers.id) == 'string'
      and redis.call('EXISTS', 'pipeline:cancel:' .. msg.headers.id) == 1 then
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[1], tag)
    redis.call('HDEL', KEYS[3], tag)
    redis.call('HDEL', KEYS[4], tag)
    redis.call('DEL', history)
    out[#out - 3] = 3
  elseif poison == 0 and type(msg.headers) == 'table' then
    local key, wait, start = slot(msg.headers)
    if key then out[#out - 2], out[#out - 1], out[#out] = key, wait, start end
  end
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

-- Grouped messages moved out of plain lists by one fetch, at most: the script stays short; the rest are moved by
-- the next fetches.
local MOVE_MAX = 100
local moved = 0
for i = 5, first_result_key do
  if taken >= want then break end
  local key = KEYS[i]
  if skip[i] then  -- a paused queue: neither its list nor its groups are touched
  elseif string.sub(ARGV[8], i - 4, i - 4) == '1' then
    local items = redis.call('RPOP', key, want - taken)
    if items then
      for _, item in ipairs(items) do take(key, item, true, nil) end
    end
  else
    local state = P .. 'state:' .. key
    local grouped = redis.call('EXISTS', state) == 1
    local turn = 'p'
    if grouped then
      uncap(key)
      turn = redis.call('HGET', P .. 'turn', key) or 'p'
    end
    local plain_done = false
    while taken < want do
      if turn == 'g' then
        local item, g = from_group(key)
        if not g then
          if plain_done or redis.call('LLEN', key) == 0 then break end
          turn = 'p'
        else
          if item then take(key, item, false, g) end
          local skipped = not item and redis.call('LLEN', P .. 'jobs:' .. key .. ':' .. g) > 0
          ready(key, g)  -- a group skipped at its cap is capped here, until one of its jobs ends
          if not plain_done and not skipped then turn = 'p' end
        end
      else
        local item = not plain_done and redis.call('RPOP', key)
        local g = item and group_of(item)
        if g and moved >= MOVE_MAX then
          redis.call('RPUSH', key, item)  -- back where it was: the next fetch moves it
          item, plain_done = nil, true
        elseif g then
          moved = moved + 1
          regroup(key, item, g)
        elseif item then
          take(key, item, false, nil)
        else
          plain_done = true
        end
        if (plain_done or not g) and redis.call('EXISTS', P .. 'ring:' .. key) == 1 then
          turn = 'g'  -- after a plain job (or none left), a group's turn
        elseif plain_done then
          break
        end
      end
    end
    if grouped or redis.call('EXISTS', state) == 1 then redis.call('HSET', P .. 'turn', key, turn) end
  end
end
return out
