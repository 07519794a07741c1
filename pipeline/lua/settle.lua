-- Settle deliveries: store the results they carry, then acknowledge each one this worker still holds (fenced).
-- A result is stored only while its delivery is held by this owner (as store.lua), so a fenced job leaves no result
-- of this worker's either.
-- Runs at maxmemory: its first write frees memory (an acknowledgement's ZREM, or `store`'s DEL).
--- @include "results"
--- @include "acknowledge"

-- settle(KEYS, ARGV):
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries,
-- KEYS[5..4+n] the task key of each result.
-- ARGV[1] the owner, ARGV[2] the delivery history's key prefix, ARGV[3] the number of results n,
-- ARGV[4..3+3n] n triples (encoded result meta, expiry in seconds (0: none), the job's delivery tag ('': none)),
-- ARGV[4+3n..] the tags to acknowledge.
-- Returns the tags it left alone (fenced: this owner no longer holds them).
local function settle(KEYS, ARGV)
  local nres = tonumber(ARGV[3])
  store_held(KEYS[3], ARGV[1], KEYS, 4, ARGV, 3, nres)
  return acknowledge(KEYS, ARGV[1], ARGV[2], ARGV, 4 + 3 * nres)
end

return settle(KEYS, ARGV)
