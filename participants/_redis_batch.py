"""The Redis adapter's batch path: a run of new steps in one server-side script call.

Why: a step on the WATCH/MULTI/EXEC path (:mod:`participants._redis_unit`) costs three
round trips, and a participant on Redis spent most of its time waiting on them. Here a
run of consecutive *new* requests of a batch goes to Redis as one ``EVALSHA`` of
:data:`SCRIPT` (redis-py's :class:`redis.commands.core.Script` loads it once and loads
it again when the server answers ``NOSCRIPT``), at most :data:`CHUNK` steps per call.

One barrier. The barrier stays :func:`participants._barrier.plan`, in Python. For each
request Python asks it what to do *assuming the ledger knows nothing of the
transaction* (no entry for the step, no rollback marker, no other fingerprint), and
builds the ledger entries to write (the applied one, and the failed one for a business
rejection) as JSON. The script's only ledger decision is to check that assumption:
the transaction's ledger hash must not exist yet, or hold only entries this same call
wrote for the same request (same fingerprint, another step). When it does not hold
(a repeat, a rollback marker, a seen marker, an older entry of the transaction, a
record this path leaves to Python), the script stops there and returns what it did
so far: :class:`RedisBatch` runs that item on the per-step path (which reads the
ledger and asks the barrier with what it finds), then sends the rest. So every case
but "a new step" is decided exactly as before, by the same code.

What the script does per step, in batch order (a key touched by several steps sees the
earlier ones' effect): ``increment`` of an integer field by an integer within signed
64 bits, with integer bounds, through ``HINCRBY``; a result outside ``[min, max]`` puts
the old text back and records that step ``failed`` (it fails alone); a missing record or
field is a rejection too; a plan without an effect (deadline passed, sequential step
waiting for its predecessor, a request after its successor's compensation) writes its
entry; then the ledger entry, and at the end the in-flight set and finished sorted set
of every transaction it wrote (see :mod:`participants._redis`). Anything else (a decimal
field or ``by``, float bounds, a non-canonical or non-numeric field text, a record key
holding another type, ``HINCRBY`` overflowing 64 bits, the other built-in actions,
custom handlers) runs on the per-step path, with today's number handling and messages.

Atomicity: a script runs alone on the server, so each call is one atomic unit; the
before-image and the ledger entry are written by the same call as the change. The
script checks the types of the keys it writes before its first write, so an error
cannot stop it half-way. Clients on the per-step path WATCH what they read: a script
that writes one of those keys makes their ``EXEC`` fail and their step run again.

Hostile input: nothing from a record becomes script text. The script is a constant;
steps travel as ``KEYS``/``ARGV`` values, which Lua only compares, concatenates and
passes to Redis commands. JSON is built in Python (:func:`participants._ledger.entry_json`);
the script only splices in the old field text (``cjson.encode`` of a string) or the
rejection reason where Python left a marker.

Cluster: every key a call touches is passed in ``KEYS``; on Redis Cluster they must all
live on one node (one hash slot, e.g. a ``{tag}`` in the prefix), else the server
refuses the call with ``CROSSSLOT``. This adapter talks to one Redis node.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, cast

import redis

from participants._actions import Increment, is_builtin, parse_action
from participants._barrier import Effect, LedgerEntry, LedgerStatus, Requested, finished_ms, plan
from participants._handlers import BuiltinsFirst, WithHandlers
from participants._ledger import RedisLedgerKeys, entry_json, field_of_step
from participants._redis_actions import RedisActions
from participants._redis_session import record_key
from participants._redis_unit import TX_ID, may_wait
from participants._storage import Actions, Report, WorkItem
from streams import BusinessRejection, StepStatus

CHUNK: Final = 500
"""Steps per script call: bounds one call's ``ARGV`` and how long it holds the server."""

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

_SPLICE: Final = "\u2063saga-splice\u2063"
"""Where the script puts a value into Python's JSON (never a valid step value: see
:func:`_halves`, which refuses a text holding it twice)."""

# ARGV per step (after the two counters at ARGV[1], ARGV[2]); KEYS per step: ledger, record.
_WIDTH: Final = 14

SCRIPT: Final = r"""
-- KEYS[1] in-flight set, KEYS[2] finished sorted set, then per step: ledger hash, record.
-- ARGV[1] steps, ARGV[2] width; per step (base b): kind ("inc" or "put"), tx id,
-- ledger field, fingerprint, applied head, applied tail, failed head, failed tail,
-- record field, by, min, max, flags applied ("w" may wait, then finished ms or "-"),
-- reason texts joined by "\n": where-prefix, below, above, missing record, missing field.
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
local function canonical(text)
  return text == '0' or (string.find(text, '^%-?[1-9]%d*$') ~= nil and #text <= 20)
end
local n, width = tonumber(ARGV[1]), tonumber(ARGV[2])
local txs, order, out = {}, {}, {}
for i = 1, n do
  local b = 2 + (i - 1) * width
  local kind, tx, field, fp = ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]
  local lk, rk = KEYS[2 + 2 * i - 1], KEYS[2 + 2 * i]
  local seen = txs[tx]
  if seen == nil then
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
  redis.call('HSET', lk, field, entry)
  if seen == nil then
    seen = {fp = fp, fields = {}, wait = false, done = true, at = 0}
    txs[tx] = seen
    table.insert(order, tx)
  end
  seen.fields[field] = true
  if string.sub(flags, 1, 1) == 'w' then seen.wait = true end
  local at = string.sub(flags, 2)
  if at == '-' then seen.done = false else seen.at = math.max(seen.at, tonumber(at)) end
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


@dataclass(frozen=True, slots=True)
class Prepared:
    """One new step ready for the script: its item, keys, arguments, and what to report
    for each outcome the script may return."""

    item: Requested
    keys: tuple[str, str]
    args: tuple[str, ...]
    emit: Report | None  # for "w" (an entry written as Python built it)


def builtin_here(actions: Actions[Any], action: str) -> bool:
    """Whether ``action`` runs as the adapter's built-in (no custom handler replaces it)."""
    if not is_builtin(action):
        return False
    if isinstance(actions, WithHandlers):
        return action not in actions.handlers and isinstance(actions.builtin, RedisActions)
    if isinstance(actions, BuiltinsFirst):
        return isinstance(actions.builtin, RedisActions)
    return isinstance(actions, RedisActions)


def _flags(entry: LedgerEntry) -> str:
    done = finished_ms(entry)
    return ("w" if may_wait(entry) else "n") + ("-" if done is None else str(done))


def _halves(entry: LedgerEntry) -> tuple[str, str] | None:
    """``entry_json(entry)`` cut where its one :data:`_SPLICE` string value stands."""
    parts = entry_json(entry).split(json.dumps(_SPLICE))
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _int64(value: Any) -> bool:
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def prepare(
    item: WorkItem,
    actions: Actions[Any],
    keys: RedisLedgerKeys,
    prefix: str,
    targets: frozenset[str],
) -> Prepared | None:
    """``item`` ready for the script, or ``None`` when it takes the per-step path."""
    if not isinstance(item, Requested) or item.fail_reason is not None:
        return None
    if not isinstance(item.tx_id, str) or not TX_ID.fullmatch(item.tx_id):
        return None  # the per-step path raises the wire-contract error
    if type(item.step) is not int or item.step < 0:
        return None
    p = plan(None, False, item, None)
    target = p.entry
    if target is None:
        return None
    ledger = keys.tx(item.tx_id)
    fp = item.fingerprint or ""
    field = field_of_step(item.step)
    if p.effect is Effect.NONE:
        emit = None if p.emit is None else _report(item, p.emit, target.reason)
        head = entry_json(target)
        return Prepared(
            item,
            (ledger, ledger),
            (
                "put",
                item.tx_id,
                field,
                fp,
                head,
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                _flags(target) + ";",
                "",
            ),
            emit,
        )
    if p.effect is not Effect.APPLY or not builtin_here(actions, target.action or ""):
        return None
    failed = replace(target, status=LedgerStatus.FAILED, effect=False)
    try:
        parsed = parse_action(target.action or "", target.args or {}, targets)
        if not isinstance(parsed, Increment):
            return None
        record = record_key(prefix, parsed.target, parsed.key)
    except BusinessRejection as exc:
        rejected = replace(failed, reason=exc.reason)
        return Prepared(
            item,
            (ledger, ledger),
            (
                "put",
                item.tx_id,
                field,
                fp,
                entry_json(rejected),
                "",
                "",
                "",
                "",
                "",
                "",
                "",
                _flags(rejected) + ";",
                "",
            ),
            _report(item, StepStatus.FAILED, exc.reason),
        )
    if not (_int64(parsed.by) and all(b is None or _int64(b) for b in (parsed.min, parsed.max))):
        return None
    applied = _halves(replace(target, before={parsed.field: _SPLICE}))
    failing = _halves(replace(failed, reason=_SPLICE))
    if applied is None or failing is None:
        return None
    where = f"{parsed.target}/{parsed.key}"
    reasons = (
        f"{where} {parsed.field} would be ",
        f", below the minimum {parsed.min}",
        f", above the maximum {parsed.max}",
        f"{where} does not exist",
        f"{where} has no value in {parsed.field}",
    )
    if any("\n" in r for r in reasons):
        return None
    flags = _flags(target) + ";" + _flags(replace(failed, reason=""))
    args = (
        "inc",
        item.tx_id,
        field,
        fp,
        *applied,
        *failing,
        parsed.field,
        str(parsed.by),
        "" if parsed.min is None else str(parsed.min),
        "" if parsed.max is None else str(parsed.max),
        flags,
        "\n".join(reasons),
    )
    return Prepared(item, (ledger, record), args, None)


def _report(item: Requested, status: StepStatus, reason: str | None) -> Report:
    keep = status in (StepStatus.FAILED, StepStatus.COMPENSATION_FAILED)
    return Report(item.tx_id, item.step, status, reason if keep else None)


class RedisBatch:
    """Sends runs of :class:`Prepared` steps to the script; a step it leaves goes to
    ``slow`` (the per-step path), and the run goes on after it."""

    def __init__(self, client: redis.Redis, keys: RedisLedgerKeys) -> None:
        self.keys = keys
        self.script = client.register_script(SCRIPT)

    def run(
        self, steps: Sequence[Prepared], slow: Callable[[WorkItem], list[Report]]
    ) -> list[Report]:
        reports: list[Report] = []
        at = 0
        while at < len(steps):
            chunk = steps[at : at + CHUNK]
            done = self._call(chunk)
            for step, (code, text) in zip(chunk, done, strict=False):
                reports.extend(_outcome(step, code, text))
            at += len(done)
            if len(done) < len(chunk):
                reports.extend(slow(steps[at].item))
                at += 1
        return reports

    def _call(self, chunk: Sequence[Prepared]) -> list[tuple[str, str]]:
        keys = [self.keys.in_flight, self.keys.finished]
        args: list[str | int] = [len(chunk), _WIDTH]
        for step in chunk:
            keys.extend(step.keys)
            args.extend(step.args)
        raw = cast(list[str], self.script(keys=keys, args=args))
        return list(zip(raw[::2], raw[1::2], strict=True))


def _outcome(step: Prepared, code: str, text: str) -> list[Report]:
    item = step.item
    if code == "a":
        return [Report(item.tx_id, item.step, StepStatus.APPLIED)]
    if code == "r":
        return [Report(item.tx_id, item.step, StepStatus.FAILED, text)]
    return [] if step.emit is None else [step.emit]
