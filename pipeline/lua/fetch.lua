-- The worker's fetch: settle what the last batch left (results, then fenced acknowledgements, as settle.lua), then
-- pop up to ARGV[9] messages over the consumed keys in kombu's order and record each as held by this worker, in
-- the same step: kombu's unacked record and index entry (as kombu's QoS.append writes them), the lease owner, the
-- delivery count and a bounded delivery history.
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries, KEYS[5..] the queue
-- keys in kombu's order (priority steps, then queues), then the task key of each result to store (the last n).
-- ARGV[1] now, ARGV[2] the owner, ARGV[3] the worker's node name, ARGV[4] a fresh tag prefix for elements that are
-- not message envelopes, ARGV[5] the delivery history's key prefix, ARGV[6] its length, ARGV[7] its TTL (seconds),
-- ARGV[8] when the lease expires (the index score, so a sweep never judges a lease by its own clock),
-- ARGV[9] how many elements to take at most, ARGV[10] the number of results n, ARGV[11..10+2n] n pairs (encoded
-- result meta, expiry), ARGV[11+2n..] the tags to acknowledge.
-- Returns {the tags whose acknowledgement was fenced}, then 5 fields per element, oldest first: key, tag,
-- delivery count, the element, 1 when the element is not an envelope (it is dead-lettered by the worker).

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

local nres = tonumber(ARGV[10])
local first_result_key = #KEYS - nres
for r = 1, nres do
  store(KEYS[first_result_key + r], ARGV[10 + 2 * r - 1], ARGV[10 + 2 * r])
end

local fenced = {}
for i = 11 + 2 * nres, #ARGV do
  local tag = ARGV[i]
  if redis.call('HGET', KEYS[3], tag) == ARGV[2] then
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[1], tag)
    redis.call('HDEL', KEYS[3], tag)
    redis.call('HDEL', KEYS[4], tag)
    redis.call('DEL', ARGV[5] .. tag)
  else
    fenced[#fenced + 1] = tag
  end
end

local out = {fenced}
local want = tonumber(ARGV[9])
local taken = 0
for i = 5, first_result_key do
  if taken >= want then break end
  local items = redis.call('RPOP', KEYS[i], want - taken)
  if items then
    for _, item in ipairs(items) do
      taken = taken + 1
      local tag, record
      local ok, msg = pcall(cjson.decode, item)
      if ok and type(msg) == 'table' and type(msg.properties) == 'table' then
        local p = msg.properties
        local di = p.delivery_info
        if type(p.delivery_tag) == 'string' and type(di) == 'table'
            and di.exchange ~= nil and di.routing_key ~= nil then
          tag = p.delivery_tag
          record = '[' .. item .. ',' .. cjson.encode(di.exchange) .. ',' .. cjson.encode(di.routing_key) .. ']'
        end
      end
      local poison = 0
      if not tag then
        poison = 1
        tag = ARGV[4] .. taken
        record = '[' .. cjson.encode(item) .. ',"",' .. cjson.encode(KEYS[i]) .. ']'
      end
      redis.call('HSET', KEYS[1], tag, record)
      redis.call('ZADD', KEYS[2], ARGV[8], tag)
      redis.call('HSET', KEYS[3], tag, ARGV[2])
      local n = redis.call('HINCRBY', KEYS[4], tag, 1)
      local history = ARGV[5] .. tag
      redis.call('RPUSH', history, '{"at":' .. ARGV[1] .. ',"worker":' .. cjson.encode(ARGV[3]) .. '}')
      redis.call('LTRIM', history, -tonumber(ARGV[6]), -1)
      redis.call('EXPIRE', history, tonumber(ARGV[7]))
      out[#out + 1] = KEYS[i]
      out[#out + 1] = tag
      out[#out + 1] = n
      out[#out + 1] = item
      out[#out + 1] = poison
    end
  end
end
return out
