"""The Lua script of the Redis batch path (see :mod:`participants._redis_batch`).

A constant: nothing from a record is ever part of it; steps come as ``KEYS`` and
``ARGV`` (:data:`WIDTH` values per step after the two counters). Lua in Redis is 5.1
with ``cjson``; numbers are doubles there, so integers stay text and ``HINCRBY`` does
the 64-bit arithmetic, and the script's ``cmp`` compares canonical integer texts.
"""

from __future__ import annotations

from typing import Final

WIDTH: Final = 15
"""``ARGV`` values per step; ``KEYS`` per step: the ledger hash and the record."""

SCRIPT: Final = r"""
-- KEYS[1] in-flight set, KEYS[2] finished sorted set, then per step: ledger hash, record.
-- ARGV[1] steps, ARGV[2] width; per step (base b): kind ("inc", "dec" or "put"), tx id,
-- ledger field, fingerprint, done entry (head), done tail, rejected head, rejected tail,
-- record field, by, min, max, flags ("w" may wait, then finished ms or "-"; done, then
-- rejected, split by ";"), reason texts joined by "\n" (where-prefix, below, above,
-- missing record, missing field), and the ledger hash this step was planned on ("" for
-- none: the hash must not exist; else its field count, then "field\tsha1" lines).
local function kind_of(key)
  return redis.call('TYPE', key)['ok']
end
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local t = kind_of(key)
  if t ~= 'none' and t ~= (key == KEYS[1] and 'set' or 'zset') then
    return redis.error_reply('WRONGTYPE ' .. key .. ' holds a ' .. t)
  end
end
local function cmp(a, b)  -- canonical integer texts
  local na, nb = a:sub(1, 1) == '-', b:sub(1, 1) == '-'
  if na ~= nb then return na and -1 or 1 end
  local x, y = na and a:sub(2) or a, nb and b:sub(2) or b
  local r = 0
  if #x ~= #y then r = (#x < #y) and -1 or 1
  elseif x ~= y then r = (x < y) and -1 or 1 end
  return na and -r or r
end
local function same(key, spec)
  local t = kind_of(key)
  if t ~= 'hash' and t ~= 'none' then return false end
  local count, rest = string.match(spec, '^(%d+)\n?(.*)$')
  if count == nil or redis.call('HLEN', key) ~= tonumber(count) then return false end
  for f, sha in string.gmatch(rest, '([^\t\n]*)\t(%x+)') do
    local v = redis.call('HGET', key, f)
    if not v or redis.sha1hex(v) ~= sha then return false end
  end
  return true
end
local function canonical(text)
  return text == '0' or (string.find(text, '^%-?[1-9]%d*$') ~= nil and #text <= 20)
end
local n, width = tonumber(ARGV[1]), tonumber(ARGV[2])
local txs, order, out = {}, {}, {}
for i = 1, n do
  local b = 2 + (i - 1) * width
  local kind, tx, field, fp = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]
  local lk, rk = KEYS[2 + 2 * i - 1], KEYS[2 + 2 * i]
  local seen, planned = txs[tx], ARGV[b + 15]
  if planned ~= '' then
    if seen ~= nil or not same(lk, planned) then break end
  elseif seen == nil then
    if redis.call('EXISTS', lk) == 1 then break end
  elseif seen.fp ~= fp or seen.fields[field] then
    break
  end
  local code, text, entry, flags
  if kind == 'put' then
    code, entry, flags = 'w', ARGV[b + 5], ARGV[b + 13]
  else
    local t = kind_of(rk)
    if t ~= 'none' and t ~= 'hash' then break end
    local reasons = {}
    for part in string.gmatch(ARGV[b + 14], '([^\n]*)\n?') do table.insert(reasons, part) end
    local name = ARGV[b + 9]
    local old = t == 'hash' and redis.call('HGET', rk, name) or false
    if t == 'none' then
      text = reasons[4]
    elseif not old then
      text = reasons[5]
    else
      if not canonical(old) then break end
      local ok = redis.pcall('HINCRBY', rk, name, ARGV[b + 10])
      if type(ok) == 'table' and ok['err'] then break end  -- overflow: Python's big integers
      local now = redis.call('HGET', rk, name)
      local low, high = ARGV[b + 11], ARGV[b + 12]
      if low ~= '' and cmp(now, low) < 0 then
        text = reasons[1] .. now .. reasons[2]
      elseif high ~= '' and cmp(now, high) > 0 then
        text = reasons[1] .. now .. reasons[3]
      end
      if text then
        redis.call('HSET', rk, name, old)
      elseif kind == 'dec' then
        code, entry, flags = 'a', ARGV[b + 5], ARGV[b + 13]
      else
        code, entry, flags = 'a', ARGV[b + 5] .. cjson.encode(old) .. ARGV[b + 6], ARGV[b + 13]
      end
    end
    if text then
      code, entry = 'r', ARGV[b + 7] .. cjson.encode(text) .. ARGV[b + 8]
      flags = string.sub(ARGV[b + 13], string.find(ARGV[b + 13], ';', 1, true) + 1)
    end
  end
  flags = string.sub(flags, 1, (string.find(flags, ';', 1, true) or (#flags + 1)) - 1)
  if entry ~= '' then
    redis.call('HSET', lk, field, entry)
    if seen == nil then
      -- planned on a read hash: no request of this call may add to it (fp false)
      seen = {fp = planned == '' and fp, fields = {}, wait = false, done = true, at = 0}
      txs[tx] = seen
      table.insert(order, tx)
    end
    seen.fields[field] = true
    if string.sub(flags, 1, 1) == 'w' then seen.wait = true end
    local at = string.sub(flags, 2)
    if at == '-' then seen.done = false else seen.at = math.max(seen.at, tonumber(at)) end
  end
  table.insert(out, code)
  table.insert(out, text or '')
end
for _, tx in ipairs(order) do
  local seen = txs[tx]
  if seen.wait then redis.call('SADD', KEYS[1], tx) else redis.call('SREM', KEYS[1], tx) end
  if seen.done then
    redis.call('ZADD', KEYS[2], string.format('%.0f', seen.at), tx)
  else
    redis.call('ZREM', KEYS[2], tx)
  end
end
return out
"""
