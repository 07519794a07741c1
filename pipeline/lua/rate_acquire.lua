-- Takes a slot of a cluster-wide rate limit (`pipeline.scheduling.ratelimit.acquire`): GCRA with
-- reservation, on Redis's own clock (TIME), so every worker on every host shares one limiter.
-- KEYS: the limiter's key (its theoretical arrival time, in ms).
-- ARGV: emission interval T and burst tolerance tau, in ms.
-- Returns the wait (ms, as a string) before the caller's slot, 0 when it may start now; the slot is taken
-- either way.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local start = tat - tau
if start < now then start = now end
local new_tat = tat + interval
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now + tau) + 1000)
return tostring(start - now)
