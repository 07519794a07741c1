-- Settle deliveries: store the results they carry, then acknowledge each one this worker still holds (fenced).
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries,
-- KEYS[5..4+n] the task key of each result.
-- ARGV[1] the owner, ARGV[2] the delivery history's key prefix, ARGV[3] the number of results n,
-- ARGV[4..3+3n] n triples (encoded result meta, expiry in seconds (0: none), the job's delivery tag ('': none)),
-- ARGV[4+3n..] the tags to acknowledge.
-- Returns the tags it left alone (fenced: this owner no longer holds them). A result is stored only while its
-- delivery is held by this owner (as store.lua), so a fenced job leaves no result of this worker's either.
-- Runs at maxmemory: its first write frees memory (an acknowledgement's ZREM, or `store`'s DEL).

-- held(lease, tag, owner): whether the result of delivery `tag` may be stored by `owner`.
local function held(lease, tag, owner)
  return tag == '' or redis.call('HGET', lease, tag) == owner
end

-- store(key, value, expires): the result backend's write, leaving a stored SUCCESS or REVOKED (cancelled) alone.
local function store(key, value, expires)
  local current = redis.call('GET', key)
  if current then
    local ok, meta = pcall(cjson.decode, current)
    if ok and type(meta) == 'table' and (meta['status'] == 'SUCCESS' or meta['status'] == 'REVOKED') then
      return 0
    end
  end
  redis.call('DEL', key)
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
  local at = 3 + 3 * (r - 1)
  if held(KEYS[3], ARGV[at + 3], ARGV[1]) then
    store(KEYS[4 + r], ARGV[at + 1], ARGV[at + 2])
  end
end

local fenced = {}
for i = 4 + 3 * nres, #ARGV do
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
