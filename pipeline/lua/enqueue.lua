-- Stores jobs due now in one call (`pipeline.producer.script.store_jobs`): each job's record (on a single Redis)
-- and its entry in the recent-jobs index, its message LPUSHed on the queue (or on its group's list), its event
-- PUBLISHed, and the claim of an idempotency key, atomically; and one wake-up marker per job (at most 16 kept) on
-- the queue's marker list, so an idle worker of the queue wakes at once (`pipeline.queues.wake`).
-- Every key is one queue's and declared in KEYS (on a Redis Cluster all of them share the queue's slot), except the
-- job records `prefix .. id`: on a cluster the prefix is '' and the producer writes the records itself, before.
-- KEYS: recent-jobs index, queue list, idempotency key (or any key of the queue, unused, when there is no claim), the
-- queue's marker list; with a group, then: the group's list, the ring of groups with jobs ready, the groups' state
-- hash and the grouped-jobs count hash (`pipeline.queues.keys`).
-- ARGV: record key prefix ('' to write no record), record, record ttl, now, index size, job count n, event channel
-- ('' for none), claim ttl ('' for no claim), group ('' for none), then n ids, n messages, and n events when there
-- is a channel.
-- A group's jobs go on its own list, and the group joins the ring (KEYS[6]) unless it is there or capped (its
-- field in KEYS[7]): the layout `fetch.lua` takes them from; KEYS[8] counts the grouped jobs waiting per queue list.
-- Returns n, or the id already holding the idempotency key (and writes nothing).
local function enqueue(KEYS, ARGV)
  local prefix, record, ttl, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
  local keep, n, channel, claim_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8]
  local group = ARGV[9]
  local first = 10
  if claim_ttl ~= '' then
    if not redis.call('SET', KEYS[3], ARGV[first], 'NX', 'EX', claim_ttl) then
      return redis.call('GET', KEYS[3])
    end
  end
  for i = first, first + n - 1 do
    if prefix ~= '' then
      redis.call('SET', prefix .. ARGV[i], record, 'EX', ttl)
    end
    redis.call('ZADD', KEYS[1], now, ARGV[i])
  end
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -keep - 1)
  local dest = KEYS[2]
  if group ~= '' then
    dest = KEYS[5]
    redis.call('HINCRBY', KEYS[8], KEYS[2], n)
    if not redis.call('HGET', KEYS[7], group) then
      redis.call('HSET', KEYS[7], group, 'r')
      redis.call('LPUSH', KEYS[6], group)
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
