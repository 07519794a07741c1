-- Settle deliveries: store the results they carry, then acknowledge each one this worker still holds (fenced).
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries,
-- KEYS[5..4+n] the task key of each result.
-- ARGV[1] the owner, ARGV[2] the delivery history's key prefix, ARGV[3] the number of results n,
-- ARGV[4..3+2n] n pairs (encoded result meta, expiry in seconds, 0: none), ARGV[4+2n..] the tags to acknowledge.
-- Returns the tags it left alone (fenced: this owner no longer holds them). Their results are stored all the same,
-- as the result backend stores a result before any acknowledgement.

-- store(key, value, expires): the result backend's write (store.lua), leaving a stored SUCCESS alone.
local function store(key, value, expires)
  local current = redis.call('GET', key)
  if current then
    local ok, meta = pcall(cjson.decode, current)
    if ok and type(meta) == 'table' and meta['status'] == 'SUCCESS' then return 0 end
  end
  if tonumber(expires) > 0 then
    redis.call('SETEX', key, expires, value)
  else
    redis.call('SET', key, value)
  end
  redis.call('PUBLISH', key, value)
  return 1
end

local nres = tonumber(ARGV[3])
for r = 1, nres do
  store(KEYS[4 + r], ARGV[3 + 2 * r - 1], ARGV[3 + 2 * r])
end

local fenced = {}
for i = 4 + 2 * nres, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[3], tag) == ARGV[1] then
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[1], tag)
    redis.call('HDEL', KEYS[3], tag)
    redis.call('HDEL', KEYS[4], tag)
    redis.call('DEL', ARGV[2] .. tag)
  else
    fenced[#fenced + 1] = tag
  end
end
return fenced
