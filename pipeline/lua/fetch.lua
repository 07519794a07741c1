-- The worker's fetch: settle what the last batch left (results, then fenced acknowledgements, as settle.lua), then
-- pop up to ARGV[9] messages over the consumed keys in kombu's order and record each as held by this worker, in
-- the same step: kombu's unacked record and index entry (as kombu's QoS.append writes them), the lease owner, the
-- delivery count and a bounded delivery history. An element of a queue consumed without acknowledgement (Celery's
-- control replies, `reply.celery.pidbox`) is popped and returned, not recorded: nothing will acknowledge it.
-- The lease expiry (the index score) is Redis's clock (TIME) plus the lease: a sweep judges every lease on it.
-- KEYS[1] unacked, KEYS[2] unacked_index, KEYS[3] pipeline:lease, KEYS[4] pipeline:deliveries, KEYS[5..] the queue
-- keys in kombu's order (priority steps, then queues), then the task key of each result to store (the last n).
-- ARGV[1] the lease (seconds), ARGV[2] the owner, ARGV[3] the worker's node name, ARGV[4] a fresh tag prefix for
-- elements that are not message envelopes, ARGV[5] the delivery history's key prefix, ARGV[6] its length,
-- ARGV[7] its TTL (seconds), ARGV[8] one character per queue key, '1' where the key is consumed without
-- acknowledgement, ARGV[9] how many elements to take at most, ARGV[10] the number of results n,
-- ARGV[11..10+3n] n triples (encoded result meta, expiry, the job's delivery tag or ''), ARGV[11+3n..] the tags to
-- acknowledge.
-- Returns {the tags whose acknowledgement was fenced}, then 5 fields per element, oldest first: key, tag (or ''),
-- delivery count (0: not recorded), the element, its kind (0 a message envelope, 1 not an envelope: dead-lettered
-- by the worker, 2 not recorded: from a queue consumed without acknowledgement, 3 a cancelled job's message: popped
-- and acknowledged here, to be dropped unrun).
-- Runs at maxmemory: each step's first write frees memory (`store`'s DEL, an acknowledgement's ZREM, the RPOP), so
-- a full Redis is drained by its workers.

-- held(lease, tag, owner): whether the result of delivery `tag` may be stored by `owner`.
local function held(lease, tag, owner)
  return tag == '' or redis.call('HGET', lease, tag) == owner
end

-- store(key, value, expires): the result backend's write (store.lua), leaving a stored SUCCESS or REVOKED alone.
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

local nres = tonumber(ARGV[10])
local first_result_key = #KEYS - nres
for r = 1, nres do
  local at = 10 + 3 * (r - 1)
  if held(KEYS[3], ARGV[at + 3], ARGV[2]) then
    store(KEYS[first_result_key + r], ARGV[at + 1], ARGV[at + 2])
  end
end

local fenced = {}
for i = 11 + 3 * nres, #ARGV do
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
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local expiry = now + tonumber(ARGV[1])
local stamp = string.format('%.3f', now)
for i = 5, first_result_key do
  if taken >= want then break end
  local items = redis.call('RPOP', KEYS[i], want - taken)
  if items then
    local untracked = string.sub(ARGV[8], i - 4, i - 4) == '1'
    for _, item in ipairs(items) do
      taken = taken + 1
      if untracked then
        out[#out + 1] = KEYS[i]
        out[#out + 1] = ''
        out[#out + 1] = 0
        out[#out + 1] = item
        out[#out + 1] = 2
      else
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
        redis.call('ZADD', KEYS[2], expiry, tag)
        redis.call('HSET', KEYS[3], tag, ARGV[2])
        local n = redis.call('HINCRBY', KEYS[4], tag, 1)
        local history = ARGV[5] .. tag
        redis.call('RPUSH', history, '{"at":' .. stamp .. ',"worker":' .. cjson.encode(ARGV[3]) .. '}')
        redis.call('LTRIM', history, -tonumber(ARGV[6]), -1)
        redis.call('EXPIRE', history, tonumber(ARGV[7]))
        out[#out + 1] = KEYS[i]
        out[#out + 1] = tag
        out[#out + 1] = n
        out[#out + 1] = item
        out[#out + 1] = poison
        -- Cancelled (`pipeline cancel`: cancel.lua wrote the tombstone pipeline:cancel:<headers.id>, the prefix of
        -- CANCEL_KEY): acknowledged here, its records just written removed as settle.lua removes them, and returned
        -- as kind 3 for the worker to drop unrun. Self-contained: nothing above depends on it.
        if poison == 0 and type(msg.headers) == 'table' and type(msg.headers.id) == 'string'
            and redis.call('EXISTS', 'pipeline:cancel:' .. msg.headers.id) == 1 then
          redis.call('ZREM', KEYS[2], tag)
          redis.call('HDEL', KEYS[1], tag)
          redis.call('HDEL', KEYS[3], tag)
          redis.call('HDEL', KEYS[4], tag)
          redis.call('DEL', history)
          out[#out] = 3
        end
      end
    end
  end
end
return out
