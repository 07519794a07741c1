-- Part: acknowledging deliveries (settle.lua, fetch.lua). K is the delivery records' keys: K[1] unacked (kombu's
-- record), K[2] unacked_index (the lease expiry), K[3] pipeline:lease (tag -> owner), K[4] pipeline:deliveries (the
-- delivery count). The index entry goes first: at maxmemory that ZREM is a write that frees memory.

-- forget(K, tag, history): remove delivery `tag`'s records and its delivery history (key `history`).
local function forget(K, tag, history)
  redis.call('ZREM', K[2], tag)
  redis.call('HDEL', K[1], tag)
  redis.call('HDEL', K[3], tag)
  redis.call('HDEL', K[4], tag)
  redis.call('DEL', history)
end

-- acknowledge(K, owner, prefix, tags, first): forget tags[first..] that `owner` still holds (their histories are
-- prefix .. tag); returns the others (fenced: this owner no longer holds them).
local function acknowledge(K, owner, prefix, tags, first)
  local fenced = {}
  for i = first, #tags do
    local tag = tags[i]
    if redis.call('HGET', K[3], tag) == owner then
      forget(K, tag, prefix .. tag)
    else
      fenced[#fenced + 1] = tag
    end
  end
  return fenced
end
