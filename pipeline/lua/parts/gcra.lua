-- Part: one slot of a cluster-wide rate limit, GCRA with reservation on Redis's clock (rate_acquire.lua, fetch.lua).

-- gcra(key, interval, tau, now): take the next slot of the limiter at `key` (its theoretical arrival time), with
-- emission interval `interval`, burst tolerance `tau` and `now` in ms on Redis's clock; returns the wait before the
-- slot and the slot, as strings (ms).
local function gcra(key, interval, tau, now)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat < now then tat = now end
  local start = tat - tau
  if start < now then start = now end
  local new_tat = tat + interval
  redis.call('SET', key, tostring(new_tat), 'PX', math.ceil(new_tat - now + tau) + 1000)
  return tostring(start - now), tostring(start)
end
