-- The worker's fetch: settle what the last batch left (results, then fenced acknowledgements, as settle.lua, then
-- fan-out items' nodes of flows), then
-- pop up to ARGV[9] messages over the consumed keys in kombu's order and record each as held by this worker, in
-- the same step: kombu's unacked record and index entry (as kombu's QoS.append writes them), the lease owner, the
-- delivery count and a bounded delivery history. An element of a queue consumed without acknowledgement (Celery's
-- control replies, `reply.celery.pidbox`) is popped and returned, not recorded: nothing will acknowledge it.
-- The lease expiry (the index score) is Redis's clock (TIME) plus the lease, rounded up to the whole second as
-- renew.lua does: a sweep judges every lease on it.
-- A node is recorded as flow_advance.lua records a fan-out item offering no step (with its `record` and `finish`:
-- parts/flow_node.lua), after the results and acknowledgements: a solo worker's item costs no call of its own
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
-- Runs at maxmemory: each step's first write frees memory (`store`'s DEL, an acknowledgement's ZREM, the RPOP), so
-- a full Redis is drained by its workers.
--- @include "results"
--- @include "acknowledge"
--- @include "flow_node"
--- @include "gcra"

-- fetch(KEYS, ARGV):
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries, KEYS[5..] the queue
-- keys in kombu's order (priority steps, then queues), then the task key of each result to store (n of them), then
-- the hash of the flow of each node to record (r of them: `pipeline:flow:{<id>}`), then last the set of paused queue
-- names (`pipeline:paused`), or on a cluster the queue's paused flag (`pipeline:{<q>}:paused`, a string: one call
-- fetches from one queue there).
-- ARGV[1] the lease (seconds), ARGV[2] the owner, ARGV[3] the worker's node name, ARGV[4] a fresh tag prefix for
-- elements that are not message envelopes, ARGV[5] the delivery history's key prefix, ARGV[6] its length,
-- ARGV[7] its TTL (seconds), ARGV[8] one character per queue key, '1' where the key is consumed without
-- acknowledgement, ARGV[9] how many elements to take at most, ARGV[10] the number of results n, ARGV[11]
-- GROUP_CONCURRENCY (0: no cap), ARGV[12] the groups' key prefix P, ARGV[13] the number of nodes r, ARGV[14] the
-- cluster-wide limits of the worker's tasks as JSON ({task: [interval ms, tolerance ms, 1 if keyed, key base]}, or
-- '' for none), ARGV[15..14+3n] n triples (encoded result meta, expiry, the job's delivery tag or ''), then r sextuples (a fan-out
-- item's node, its result (JSON), its job's id, its step, now (epoch s), the flow keys' ttl (s)), then the tags to
-- acknowledge.
-- Returns {the tags whose acknowledgement was fenced}, {the consumed queues that are paused}, {4 fields per node, as
-- flow_advance.lua answers: 1 when this call recorded it, the flow's state ('' for no such flow), 1 when its step is
-- complete, when its step was queued if this call recorded the step's last node (else '')}, then 8 fields per
-- element, oldest first: key, tag (or ''), delivery count (0: not recorded), the element, its kind (0 a message
-- envelope, 1 not an envelope: dead-lettered by the worker, 2 not recorded: from a queue consumed without
-- acknowledgement, 3 a cancelled job's message: popped and acknowledged here, to be dropped unrun), then the limiter's
-- key of the rate slot it took, the wait before that slot and the slot on Redis's clock, in ms, as rate_acquire.lua
-- returns them ('', '', '' for none).
local function fetch(KEYS, ARGV)
  local nres = tonumber(ARGV[10])
  local nnodes = tonumber(ARGV[13])
  local first_result_key = #KEYS - nres - nnodes - 1
  store_held(KEYS[3], ARGV[2], KEYS, first_result_key, ARGV, 14, nres)
  local fenced = acknowledge(KEYS, ARGV[2], ARGV[5], ARGV, 15 + 3 * nres + 6 * nnodes)

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
  -- so the worker does not wait on a key it may not take from. Reads only; one EXISTS when nothing is paused. A
  -- queue's flag (a string, on a cluster) pauses every key of the call.
  local skip, paused = {}, {}
  local pause_key = KEYS[#KEYS]
  if redis.call('EXISTS', pause_key) == 1 then
    local seen = {}
    local flag = redis.call('TYPE', pause_key)['ok'] == 'string'
    for i = 5, first_result_key do
      local queue = string.match(KEYS[i], '^(.*)\6\22%d+$') or KEYS[i]
      if flag then queue = string.match(queue, '^{(.*)}$') or queue end
      if seen[queue] == nil then
        seen[queue] = flag or redis.call('SISMEMBER', pause_key, queue) == 1
        if seen[queue] then paused[#paused + 1] = queue end
      end
      skip[i] = seen[queue]
    end
  end

  local out = {fenced, paused, answers}
  local P = ARGV[12]

  -- Nothing to take (an idle worker's fetch, most of its calls): every key it could take from is read by one
  -- EXISTS (a few hundred at a time) instead of two or three calls per key below; a key that exists goes the long way.
  local watched = {}
  for i = 5, first_result_key do
    if not skip[i] then
      local key = KEYS[i]
      watched[#watched + 1] = key
      if string.sub(ARGV[8], i - 4, i - 4) ~= '1' then
        watched[#watched + 1] = P .. 'state:' .. key
        watched[#watched + 1] = P .. 'ring:' .. key
      end
    end
  end
  local found = 0
  for from = 1, #watched, 300 do
    if found > 0 then break end
    found = redis.call('EXISTS', unpack(watched, from, math.min(from + 299, #watched)))
  end
  if found == 0 then return out end

  local want = tonumber(ARGV[9])
  local taken = 0
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local expiry = math.ceil(now + tonumber(ARGV[1]))  -- whole seconds: see renew.lua
  local stamp = string.format('%.3f', now)
  local cap = tonumber(ARGV[11])
  local tombstones = string.gsub(P, 'group:$', 'cancel:')  -- pipeline:cancel:, or pipeline:{<q>}:cancel:
  local limits = ARGV[14] ~= '' and cjson.decode(ARGV[14]) or nil
  local now_ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000

  --- @include "fetch_take"
  --- @include "fetch_groups"

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
      if not grouped then
        -- No group of this key has jobs: its plain jobs in one RPOP, taken in order until one names a group, which
        -- goes back with the rest (where they were) for the step-by-step loop below to move to its group.
        local asked = want - taken
        local items = redis.call('RPOP', key, asked) or {}
        local stopped = false
        for n, item in ipairs(items) do
          if group_of(item) then
            local rest = {}
            for k = #items, n, -1 do rest[#rest + 1] = items[k] end
            redis.call('RPUSH', key, unpack(rest))
            stopped = true
            break
          end
          take(key, item, false, nil)
        end
        plain_done = not stopped and #items < asked
      end
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
            grouped = true  -- the key has a group now: its turn is kept below
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
      if grouped then redis.call('HSET', P .. 'turn', key, turn) end
    end
  end
  return out
end

return fetch(KEYS, ARGV)
