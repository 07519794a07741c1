-- Compare-and-set of a once-guard's key (`pipeline.once.Once`): one state transition, only from the exact
-- value the caller last wrote, so two concurrent copies of one job cannot both move the key on.
-- KEYS: the once key.
-- ARGV: the value expected, the new value ('' to delete the key), the new value's ttl in seconds.
-- Returns 1 when the key held the expected value (now replaced or deleted), else 0 (nothing written).
local function once_cas(KEYS, ARGV)
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
  if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
  return 1
end

return once_cas(KEYS, ARGV)
