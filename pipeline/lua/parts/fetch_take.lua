-- Part of fetch.lua, included inside `fetch` (its helpers close over the fetch's locals): `slot`, the rate slot a
-- message takes, and `take`, which records a popped element as held by this worker and appends it to the reply.
-- Uses fetch's KEYS, ARGV, out, taken, expiry, stamp, cap, P, limits and now_ms.

-- slot(h): the rate slot a message with headers h takes here, and the wait before it (see above), or nil.
local function slot(h)
  local limit = limits and type(h.task) == 'string' and limits[h.task]
  if not limit or (h.pipeline_rate_slot ~= nil and h.pipeline_rate_slot ~= cjson.null) then return nil end
  local key = limit[4]
  if limit[3] == 1 then
    if type(h.pipeline_rate_key) ~= 'string' then return nil end
    key = key .. ':' .. h.pipeline_rate_key
  end
  local wait, start = gcra(key, tonumber(limit[1]), tonumber(limit[2]), now_ms)
  return key, wait, start
end

-- take(key, item, untracked, g): record `item` popped from `key` as held by this worker (or pass an untracked
-- one on), append it to the reply; g: its group, or nil.
local function take(key, item, untracked, g)
  taken = taken + 1
  if untracked then
    out[#out + 1] = key
    out[#out + 1] = ''
    out[#out + 1] = 0
    out[#out + 1] = item
    out[#out + 1] = 2
    for _ = 1, 3 do out[#out + 1] = '' end
    return
  end
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
    record = '[' .. cjson.encode(item) .. ',"",' .. cjson.encode(key) .. ']'
  end
  redis.call('HSET', KEYS[1], tag, record)
  redis.call('ZADD', KEYS[2], expiry, tag)
  redis.call('HSET', KEYS[3], tag, ARGV[2])
  local n = redis.call('HINCRBY', KEYS[4], tag, 1)
  local history = ARGV[5] .. tag
  local entries = redis.call('RPUSH', history, '{"at":' .. stamp .. ',"worker":' .. cjson.encode(ARGV[3]) .. '}')
  if entries > tonumber(ARGV[6]) then redis.call('LTRIM', history, -tonumber(ARGV[6]), -1) end
  redis.call('EXPIRE', history, tonumber(ARGV[7]))
  if g and cap > 0 then
    redis.call('SADD', P .. 'leases:' .. g, tag)
    redis.call('EXPIRE', P .. 'leases:' .. g, 7 * 86400)
  end
  out[#out + 1] = key
  out[#out + 1] = tag
  out[#out + 1] = n
  out[#out + 1] = item
  out[#out + 1] = poison
  for _ = 1, 3 do out[#out + 1] = '' end
  -- Cancelled (`pipeline cancel`: cancel.lua wrote the tombstone pipeline:cancel:<headers.id>, the prefix of
  -- CANCEL_KEY; pipeline:{<q>}:cancel:<id> on a cluster, named from P, the queue's group prefix): acknowledged here, its records just written removed as settle.lua removes them (`forget`), and
  -- returned as kind 3 for the worker to drop unrun (its group's slot is free again: its lease record is gone).
  if poison == 0 and type(msg.headers) == 'table' and type(msg.headers.id) == 'string'
      and redis.call('EXISTS', tombstones .. msg.headers.id) == 1 then
    forget(KEYS, tag, history)
    out[#out - 3] = 3
  elseif poison == 0 and type(msg.headers) == 'table' then
    local key, wait, start = slot(msg.headers)
    if key then out[#out - 2], out[#out - 1], out[#out] = key, wait, start end
  end
end
