-- Stores jobs due now in one call (`pipeline.producer.script.store_jobs`): each job's record and its entry
-- in the recent-jobs index, its message LPUSHed on the queue, its event PUBLISHed, and the claim of an
-- idempotency key, atomically; and one wake-up marker per job (at most 16 kept) on the queue's marker list, so an
-- idle worker of the queue wakes at once (`pipeline.producer.wake`).
-- KEYS: recent-jobs index, queue list, idempotency key (or any key, unused, when there is no claim), the queue's
-- marker list (`pipeline:wake:<queue>`).
-- ARGV: record key prefix, record, record ttl, now, index size, job count n, event channel ('' for none),
-- claim ttl ('' for no claim), then n ids, n messages, and n events when there is a channel.
-- Returns n, or the id already holding the idempotency key (and writes nothing).
local prefix, record, ttl, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local keep, n, channel, claim_ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], ARGV[8]
if claim_ttl ~= '' then
  if not redis.call('SET', KEYS[3], ARGV[9], 'NX', 'EX', claim_ttl) then
    return redis.call('GET', KEYS[3])
  end
end
for i = 9, 8 + n do
  redis.call('SET', prefix .. ARGV[i], record, 'EX', ttl)
  redis.call('ZADD', KEYS[1], now, ARGV[i])
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -keep - 1)
for i = 9 + n, 8 + 2 * n do
  redis.call('LPUSH', KEYS[2], ARGV[i])
end
-- Wake-up markers (pipeline.producer.wake.WAKE_MAX = 16): one per job, the list trimmed to 16.
for _ = 1, math.min(n, 16) do
  redis.call('LPUSH', KEYS[4], '1')
end
redis.call('LTRIM', KEYS[4], 0, 15)
if channel ~= '' then
  for i = 9 + 2 * n, 8 + 3 * n do
    redis.call('PUBLISH', channel, ARGV[i])
  end
end
return n
