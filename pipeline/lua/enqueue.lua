-- Stores jobs due now in one call (`pipeline.producer.script.store_jobs`): each job's record and its entry
-- in the recent-jobs index, its message LPUSHed on the queue (or on its group's list), its event PUBLISHed, and
-- the claim of an idempotency key, atomically; and one wake-up marker per job (at most 16 kept) on the queue's
-- marker list, so an idle worker of the queue wakes at once (`pipeline.queues.wake`).
-- KEYS: recent-jobs index, queue list, idempotency key (or any key, unused, when there is no claim), the queue's
-- marker list (`pipeline:wake:<queue>`).
-- ARGV: record key prefix, record, record ttl, now, index size, job count n, event channel ('' for none),
-- claim ttl ('' for no claim), group ('' for none), the groups' key prefix P, then n ids, n messages, and n events
-- when there is a channel.
-- A group's jobs go on P..'jobs:'..K..':'..G (K the queue list), and the group joins the ring of groups with jobs
-- ready (P..'ring:'..K) unless it is there or capped (P..'state:'..K): the layout `fetch.lua` takes them from;
-- P..'count' counts the grouped jobs waiting per queue list.
-- Returns n, or the id already holding the idempotency key (and writes nothing).
local function enqueue(KEYS, ARGV)
  local prefix, record, ttl, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
  local keep, n, channel, claim_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8]
  local group, P = ARGV[9], ARGV[10]
  local first = 11
  if claim_ttl ~= '' then
    if not redis.call('SET', KEYS[3], ARGV[first], 'NX', 'EX', claim_ttl) then
      return redis.call('GET', KEYS[3])
    end
  end
  for i = first, first + n - 1 do
    redis.call('SET', prefix .. ARGV[i], record, 'EX', ttl)
    redis.call('ZADD', KEYS[1], now, ARGV[i])
  end
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -keep - 1)
  local dest = KEYS[2]
  if group ~= '' then
    dest = P .. 'jobs:' .. KEYS[2] .. ':' .. group
    redis.call('HINCRBY', P .. 'count', KEYS[2], n)
    local state = P .. 'state:' .. KEYS[2]
    if not redis.call('HGET', state, group) then
      redis.call('HSET', state, group, 'r')
      redis.call('LPUSH', P .. 'ring:' .. KEYS[2], group)
    end
  end
  for i = first + n, first + 2 * n - 1 do
    redis.call('LPUSH', dest, ARGV[i])
  end
  -- Wake-up markers (pipeline.queues.wake.WAKE_MAX = 16): one per job, the list trimmed to 16.
  for _ = 1, math.min(n, 16) do
    redis.call('LPUSH', KEYS[4], '1')
  end
  redis.call('LTRIM', KEYS[4], 0, 15)
  if channel ~= '' then
    for i = first + 2 * n, first + 3 * n - 1 do
      redis.call('PUBLISH', channel, ARGV[i])
    end
  end
  return n
end

return enqueue(KEYS, ARGV)
