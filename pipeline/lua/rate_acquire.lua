-- Takes a slot of a cluster-wide rate limit (`pipeline.scheduling.ratelimit.acquire`): GCRA with
-- reservation, on Redis's own clock (TIME), so every worker on every host shares one limiter and one clock.
--- @include "gcra"

-- rate_acquire(KEYS, ARGV):
-- KEYS: the limiter's key (its theoretical arrival time, in ms).
-- ARGV: emission interval T and burst tolerance tau, in ms; the slot (ms, Redis's clock) a deferred job was
-- given, or '' for none. A job within half an interval of its slot starts on it; one earlier than that (held by
-- a worker whose clock runs ahead) is told to wait for the same slot; a later one asks again, so busy workers
-- cannot bunch deferred jobs into a burst. Neither of the first two takes another slot.
-- Returns {wait, slot} as strings, in ms: the wait before the caller's slot (0: start now) and that slot on Redis's
-- clock.
local function rate_acquire(KEYS, ARGV)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  local interval, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
  local carried = tonumber(ARGV[3])
  if carried and now - carried <= interval / 2 then
    if carried - now > interval / 2 then return {tostring(carried - now), ARGV[3]} end
    return {'0', ARGV[3]}
  end
  local wait, slot = gcra(KEYS[1], interval, tau, now)
  return {wait, slot}
end

return rate_acquire(KEYS, ARGV)
