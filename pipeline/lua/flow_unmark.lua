-- Takes a flow off the hand-offs to check (`pipeline.flows.reconcile`), unless a hand-off marked it again since it
-- was read: its score is still the one read.
-- flow_unmark(KEYS, ARGV): KEYS[1] the hand-offs set (`pipeline:flow-handoffs`, ZSET flow id -> when its latest
-- hand-off began). ARGV[1] the flow id, ARGV[2] the score read.
-- Returns 1 when it took the flow off, else 0.
local function flow_unmark(KEYS, ARGV)
  local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if score and tonumber(score) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
  return 0
end

return flow_unmark(KEYS, ARGV)
