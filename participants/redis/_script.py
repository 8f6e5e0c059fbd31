"""The Lua script of the Redis batch path (see :mod:`participants.redis._batch`; the
kinds of step: :mod:`participants.redis._plan`).

A constant: nothing from a record is ever part of it; steps come as ``KEYS`` and
``ARGV`` (:data:`WIDTH` values per step after the two counters). Lua in Redis is 5.1
with ``cjson``; numbers are doubles there, so integers stay text and ``HINCRBY`` does
the 64-bit arithmetic, and the script's ``cmp`` compares canonical integer texts.
"""

from __future__ import annotations

from typing import Final

WIDTH: Final = 15
"""``ARGV`` values per step; ``KEYS`` per step: the ledger hash, the record, its side hash."""

SCRIPT: Final = r"""
-- KEYS[1] in-flight set, KEYS[2] finished sorted set, then per step: ledger hash, record,
-- side hash (participants.redis._isolation).
-- ARGV[1] steps, ARGV[2] width; per step (base b): kind ("put": an entry only; level none:
-- "inc" apply an increment, "dec" compensate it; read_committed: "res" reserve, "cmt"
-- commit the reservation, "rel" release it), tx id, ledger field (the step), fingerprint,
-- done entry (head), done tail, rejected head, rejected tail, record field, by (for
-- "dec": minus the step's by), min, max, flags ("w" may wait, then finished ms or "-";
-- done, then rejected, split by ";"), reason texts joined by "\n" (would-be head, below,
-- above, missing record, missing field, where, counted, bound tail), and the ledger hash
-- this step was planned on ("" for none: the hash must not exist; else its field count,
-- then "field\tsha1" lines).
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
-- at most 15 digits: sums of three stay below 2^53, exact in Lua's doubles
local function small(text)
  return canonical(text) and #text - (text:sub(1, 1) == '-' and 1 or 0) <= 15
end
local function fmt(x)
  if x == 0 then return '0' end
  return string.format('%.0f', x)
end
local function minus(text)  -- of a canonical integer text other than "0"
  if text:sub(1, 1) == '-' then return text:sub(2) end
  return '-' .. text
end
-- the i-th of the reason texts joined by "\n" (only a step that fails needs one)
local function part(texts, i)
  local k = 0
  for piece in string.gmatch(texts, '([^\n]*)\n?') do
    k = k + 1
    if k == i then return piece end
  end
  return ''
end
-- the reason naming the saga that holds the record (nil: none, or a stale "hold")
local function held(sk, where)
  local tx = redis.call('HGET', sk, 'hold')
  if not tx then return nil end
  local head, low = 'h:' .. tx .. ':', nil
  local all = redis.call('HGETALL', sk)
  for i = 1, #all, 2 do
    local f = all[i]
    if string.sub(f, 1, #head) == head then
      local s = string.sub(f, #head + 1)
      if string.find(s, '^%d+$') then
        local v = tonumber(s)
        if low == nil or v < low then low = v end
      end
    end
  end
  if low == nil then return nil end
  return where .. ' is held by saga ' .. tx .. ' (step ' .. string.format('%d', low) ..
    ') until its decision; retry after it'
end
-- add by to a reservation counter; a counter back at 0 goes
local function count(sk, name, by)
  if redis.call('HINCRBY', sk, name, by) == 0 then redis.call('HDEL', sk, name) end
end
local function tighten(sk, name, low, high, lowb, highb)
  if low ~= '' and (not lowb or cmp(low, lowb) > 0) then
    redis.call('HSET', sk, 'min:' .. name, low)
  end
  if high ~= '' and (not highb or cmp(high, highb) < 0) then
    redis.call('HSET', sk, 'max:' .. name, high)
  end
end
local n, width = tonumber(ARGV[1]), tonumber(ARGV[2])
local txs, order, out = {}, {}, {}
for i = 1, n do
  local b = 2 + (i - 1) * width
  local kind, tx, field, fp = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]
  local lk, rk, sk = KEYS[3 * i], KEYS[3 * i + 1], KEYS[3 * i + 2]
  local seen, planned = txs[tx], ARGV[b + 15]
  if planned ~= '' then
    if seen ~= nil or not same(lk, planned) then break end
  elseif seen == nil then
    if redis.call('EXISTS', lk) == 1 then break end
  elseif seen.fp ~= fp or seen.fields[field] then
    break
  end
  local code, text, entry, flags
  local done = ARGV[b + 5] .. ARGV[b + 6]
  if kind == 'put' then
    code, entry, flags = 'w', ARGV[b + 5], ARGV[b + 13]
  else
    local name, by, low, high = ARGV[b + 9], ARGV[b + 10], ARGV[b + 11], ARGV[b + 12]
    local rfield = 'r:' .. tx .. ':' .. field
    local down = by:sub(1, 1) == '-'
    local cname = (down and 'neg:' or 'pos:') .. name
    -- every read a step needs, before its first write: a key of another type stops here
    local s = redis.pcall('HMGET', sk, 'hold', 'neg:' .. name, 'pos:' .. name,
      'min:' .. name, 'max:' .. name, rfield)
    if s['err'] then break end
    local hold, neg, pos, lowb, highb, res = s[1], s[2], s[3], s[4], s[5], s[6]
    local old = redis.pcall('HGET', rk, name)
    if type(old) == 'table' then break end
    local c = false  -- the counter by adds to (not `down and neg or pos`: neg may be false)
    if by ~= '0' then if down then c = neg else c = pos end end
    local reason = ARGV[b + 14]
    if kind == 'cmt' or kind == 'rel' then
      if res then
        if c and not canonical(c) then break end
        if kind == 'cmt' then
          if not old or not canonical(old) then break end
          local ok = redis.pcall('HINCRBY', rk, name, by)
          if type(ok) == 'table' and ok['err'] then break end
        end
        redis.call('HDEL', sk, rfield)
        if by ~= '0' then count(sk, cname, minus(by)) end
      end
      code, entry, flags = 'a', done, ARGV[b + 13]
    elseif kind == 'res' and hold == tx then
      break  -- its saga's own hold: the per-step path's view
    else
      if kind ~= 'dec' and hold then text = held(sk, part(reason, 6)) end
      if text then
      elseif not old then
        text = part(reason, redis.call('EXISTS', rk) == 0 and 4 or 5)  -- gone, or no field
      elseif not canonical(old) then
        break
      elseif kind == 'dec' then
        -- by is minus the step's; a bound it would cross refuses (counting reservations)
        local bound = false
        if by ~= '0' then if down then bound = lowb else bound = highb end end
        if bound and not canonical(bound) then break end
        local k = bound and c
        if k and not (small(k) and small(old) and small(by)) then break end
        local ok = redis.pcall('HINCRBY', rk, name, by)
        if type(ok) == 'table' and ok['err'] then break end
        if bound then
          local now = redis.call('HGET', rk, name)
          local v = k and fmt(tonumber(now) + tonumber(k)) or now
          local r = cmp(v, bound)
          if (down and r < 0) or (not down and r > 0) then
            text = part(reason, 1) .. v .. (k and part(reason, 7) or '') ..
              (down and part(reason, 2) or part(reason, 3)) .. bound .. part(reason, 8)
            redis.call('HSET', rk, name, old)
          end
        end
        if not text then code, entry, flags = 'a', done, ARGV[b + 13] end
      else
        neg, lowb = low ~= '' and neg, low ~= '' and lowb
        pos, highb = high ~= '' and pos, high ~= '' and highb
        if (neg and not small(neg)) or (pos and not small(pos)) then break end
        if (lowb and not canonical(lowb)) or (highb and not canonical(highb)) then break end
        if kind == 'inc' then
          local exact = small(old) and small(by)
          if (neg or pos) and not exact then break end
          local ok = redis.pcall('HINCRBY', rk, name, by)
          if type(ok) == 'table' and ok['err'] then break end  -- overflow: Python's big integers
          local now = exact and fmt(tonumber(old) + tonumber(by)) or redis.call('HGET', rk, name)
          local lv = neg and fmt(tonumber(now) + tonumber(neg)) or now
          local hv = pos and fmt(tonumber(now) + tonumber(pos)) or now
          if low ~= '' and cmp(lv, low) < 0 then
            text = part(reason, 1) .. lv .. (neg and part(reason, 7) or '') .. part(reason, 2)
          elseif high ~= '' and cmp(hv, high) > 0 then
            text = part(reason, 1) .. hv .. (pos and part(reason, 7) or '') .. part(reason, 3)
          end
          if text then
            redis.call('HSET', rk, name, old)
          else
            tighten(sk, name, low, high, lowb, highb)
            code, entry = 'a', ARGV[b + 5] .. cjson.encode(old) .. ARGV[b + 6]
            flags = ARGV[b + 13]
          end
        else  -- res: escrow, the record unchanged
          if not (small(old) and small(by)) or (c and not small(c)) then break end
          local d = tonumber(by)
          if low ~= '' then
            local lv = fmt(tonumber(old) + (neg and tonumber(neg) or 0) + math.min(d, 0))
            if cmp(lv, low) < 0 then
              text = part(reason, 1) .. lv .. (neg and part(reason, 7) or '') .. part(reason, 2)
            end
          end
          if not text and high ~= '' then
            local hv = fmt(tonumber(old) + (pos and tonumber(pos) or 0) + math.max(d, 0))
            if cmp(hv, high) > 0 then
              text = part(reason, 1) .. hv .. (pos and part(reason, 7) or '') .. part(reason, 3)
            end
          end
          if not text then
            redis.call('HSET', sk, rfield, name .. ':' .. by)
            if by ~= '0' then count(sk, cname, by) end
            tighten(sk, name, low, high, lowb, highb)
            code, entry, flags = 'a', done, ARGV[b + 13]
          end
        end
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
