-- Releases parked delayed jobs that are due (`pipeline.scheduling.delayed.release_due`): each entry due by
-- the horizon is LPUSHed on its queue (as kombu does) and deleted, atomically, so an entry is released
-- exactly once however many releasers run. An entry missing its message or its queue is deleted unreleased.
-- Each release also pushes a wake-up marker on its queue's marker list (`pipeline.queues.wake`: ARGV[3] followed
-- by the queue's name, the list key without kombu's priority suffix), trimmed to 16, so an idle worker wakes at
-- once. On a single Redis the keys are shared by every queue and the marker keys, built from the entries, are not
-- in KEYS; on a Redis Cluster each call is one queue's (its delayed keys, lists and marker all in its slot) and the
-- queue's marker list is KEYS[4].
-- KEYS: the due-time index (sorted set of ids), the messages (hash id -> body), the queues (hash id -> list), and on
-- a cluster the queue's marker list.
-- ARGV: the horizon (epoch seconds: entries scored up to it are due), the most entries to release, the marker
-- key prefix (`pipeline:wake:`; unused with KEYS[4]).
-- Returns how many entries were pushed onto a queue. Runs at maxmemory: an entry is deleted (a write that frees
-- memory) before its message is pushed.
local function delayed_release(KEYS, ARGV)
  local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
  local released = 0
  for _, id in ipairs(due) do
    local dest = redis.call('HGET', KEYS[3], id)
    local body = redis.call('HGET', KEYS[2], id)
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    if dest and body then
      redis.call('LPUSH', dest, body)
      released = released + 1
      local wake = KEYS[4]
      if not wake then
        local cut = string.find(dest, '\6\22', 1, true)
        wake = ARGV[3] .. (cut and string.sub(dest, 1, cut - 1) or dest)
      end
      redis.call('LPUSH', wake, '1')
      redis.call('LTRIM', wake, 0, 15)
    end
  end
  return released
end

return delayed_release(KEYS, ARGV)
