"""The Redis adapter's batch path: runs of a batch's steps in one server-side script call.

Why: a step on the WATCH/MULTI/EXEC path (:mod:`participants._redis_unit`) costs three
round trips, and a participant on Redis spent most of its time waiting on them. Here a
run of consecutive steps of a batch goes to Redis as one ``EVALSHA`` of
:data:`participants._redis_script.SCRIPT` (redis-py's ``Script`` loads it once and
again when the server answers ``NOSCRIPT``), at most :data:`CHUNK` steps per call.

One barrier. The barrier stays :func:`participants._barrier.plan`, in Python
(:class:`Planner`), and the script checks that the ledger is what the plan assumed:

* a request is planned on a ledger that knows nothing of its transaction (no entry,
  no marker, no other fingerprint); the script checks that the transaction's hash does
  not exist, or holds only entries this same call wrote for the same request;
* a rollback decision is planned on the transaction's hash as read, for the whole run
  in one pipelined round trip before the call (a transaction with no step here gets
  the rollback marker, one with one step is compensated or closed as the barrier
  says; more steps: per step); the script checks the hash still holds exactly those
  fields and texts (their count and SHA-1s).

When the check fails (a repeat, a marker, an older entry, a hash changed since it was
read, a record this path leaves to Python), the script stops there and returns what it
did so far: :class:`RedisBatch` runs that item on the per-step path (which reads the
ledger and asks the barrier with what it finds), then sends the rest.

What the script does per step, in batch order (a key touched by several steps sees the
earlier ones' effect): ``increment`` of an integer field by an integer within signed
64 bits, with integer bounds, through ``HINCRBY``; a result outside ``[min, max]`` puts
the old text back and records that step ``failed`` (it fails alone); a missing record or
field is a rejection too; its compensation subtracts ``by`` the same way (a missing
record or field: ``compensation_failed``); a plan without an effect writes its entry
(deadline passed, waiting for a neighbour, a null compensation, the rollback marker);
then the ledger entry, and at the end the in-flight set and finished sorted set of every
transaction it wrote (see :mod:`participants._redis`). Anything else (a decimal field or
``by``, float bounds, a non-canonical or non-numeric field text, a record key holding
another type, ``HINCRBY`` overflowing 64 bits, the other built-in actions, custom
handlers, commit decisions, a neighbour's signal) runs on the per-step path, with
today's number handling and messages.

Atomicity: a script runs alone on the server, so each call is one atomic unit; the
before-image and the ledger entry are written by the same call as the change. The
script checks the types of the in-flight and finished keys before its first write, and
of a step's keys before that step's first write, so no error stops it inside a step.
Clients on the per-step path WATCH what they read: a script that writes one of those
keys makes their ``EXEC`` fail and their step run again.

Hostile input: nothing from a record becomes script text. The script is a constant;
steps travel as ``KEYS``/``ARGV`` values, which Lua only compares, concatenates and
passes to Redis commands. JSON is built in Python (:func:`participants._ledger.entry_json`);
the script only splices in the old field text (``cjson.encode`` of a string) or the
rejection reason where Python left a marker (:data:`_SPLICE`).

Cluster: every key a call touches is passed in ``KEYS``; on Redis Cluster they must all
live on one node (one hash slot, e.g. a ``{tag}`` in the prefix), else the server
refuses the call with ``CROSSSLOT``. This adapter talks to one Redis node.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, cast

import redis

from saga.participants._actions import Increment, is_builtin, parse_action
from saga.participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    Requested,
    finished_ms,
    plan,
)
from saga.participants._handlers import BuiltinsFirst, WithHandlers
from saga.participants._ledger import (
    MARKER_STEP,
    RedisLedgerKeys,
    entry_json,
    entry_of_json,
    field_of_step,
    rolled_back_marker,
    step_of_field,
)
from saga.participants._storage import Actions, DecisionArrived, Report, WorkItem
from saga.participants.redis._actions import RedisActions
from saga.participants.redis._script import SCRIPT, WIDTH
from saga.participants.redis._session import record_key, strings
from saga.participants.redis._unit import TX_ID, may_wait
from saga.streams import BusinessRejection, Outcome, StepStatus

CHUNK: Final = 500
"""Steps per script call: bounds one call's ``ARGV`` and how long it holds the server."""

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

_SPLICE: Final = "\u2063saga-splice\u2063"
"""Where the script puts a value into Python's JSON. A step's own values may hold it
too (a key, a fingerprint): :func:`_halves` then finds it twice and the step takes the
per-step path."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """One step ready for the script: the item it came from, the step it reports on,
    its keys and arguments, what to report when it is done (``"a"``, ``"w"``) and the
    status of a rejection (``"r"``, with the reason the script returns)."""

    item: WorkItem
    tx_id: str
    step: int
    keys: tuple[str, str]
    args: tuple[str, ...]
    emit: Report | None
    rejected: StepStatus = StepStatus.FAILED


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


def _hash_flags(fields: Mapping[str, LedgerEntry]) -> str:
    """:func:`_flags` of a whole transaction hash, decoded (as :meth:`RedisUnit.write`
    decides with :func:`~participants._redis_unit.tx_finished_ms` and ``may_wait``)."""
    finished = [finished_ms(entry) for entry in fields.values()]
    done = None if None in finished else max(cast(list[int], finished), default=None)
    wait = any(may_wait(e) for name, e in fields.items() if step_of_field(name) is not None)
    return ("w" if wait else "n") + ("-" if done is None else str(done))


def _halves(entry: LedgerEntry) -> tuple[str, str] | None:
    """``entry_json(entry)`` cut where its one :data:`_SPLICE` string value stands."""
    parts = entry_json(entry).split(json.dumps(_SPLICE))
    return (parts[0], parts[1]) if len(parts) == 2 else None


def _int64(value: Any) -> bool:
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def _canonical(text: Any) -> bool:
    return isinstance(text, str) and _int64_text(text)


def _int64_text(text: str) -> bool:
    try:
        return str(int(text)) == text and _int64(int(text))
    except ValueError:
        return False


def _planned_on(fields: Mapping[str, str]) -> str | None:
    """The script's picture of a read ledger hash (``None``: a field it cannot name)."""
    if any("\t" in name or "\n" in name for name in fields):
        return None
    # SHA-1 because the script has redis.sha1hex; a digest of our own ledger, not a secret
    lines = [
        f"{name}\t{hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()}"
        for name, text in fields.items()
    ]
    return "\n".join([str(len(fields)), *lines])


def _put(entry: str, flags: str, planned: str = "") -> tuple[str, ...]:
    return ("put", entry, "", "", "", "", "", "", "", flags + ";", "", planned)


class Planner:
    """Turns work items into :class:`Prepared` steps (``None``: the per-step path)."""

    def __init__(
        self, actions: Actions[Any], keys: RedisLedgerKeys, prefix: str, targets: frozenset[str]
    ) -> None:
        self.actions = actions
        self.keys = keys
        self.prefix = prefix
        self.targets = targets

    def request(self, item: WorkItem) -> Prepared | None:
        """A new request, planned on a ledger that knows nothing of its transaction."""
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
        fp = item.fingerprint or ""
        if p.effect is Effect.NONE:
            emit = _emit(item.tx_id, item.step, p.emit, target, None, self.actions)
            return self._put(item, item.step, target, _flags(target), fp, "", emit)
        if p.effect is not Effect.APPLY:
            return None
        failed = replace(target, status=LedgerStatus.FAILED, effect=False)
        parsed = self._parsed(target)
        if isinstance(parsed, BusinessRejection):
            rejected = replace(failed, reason=parsed.reason)
            report = Report(item.tx_id, item.step, StepStatus.FAILED, parsed.reason)
            return self._put(item, item.step, rejected, _flags(rejected), fp, "", report)
        if parsed is None:
            return None
        increment, record = parsed
        if not all(b is None or _int64(b) for b in (increment.min, increment.max)):
            return None
        applied = _halves(replace(target, before={increment.field: _SPLICE}))
        failing = _halves(replace(failed, reason=_SPLICE))
        if applied is None or failing is None:
            return None
        where = f"{increment.target}/{increment.key}"
        reasons = (
            f"{where} {increment.field} would be ",
            f", below the minimum {increment.min}",
            f", above the maximum {increment.max}",
            f"{where} does not exist",
            f"{where} has no value in {increment.field}",
        )
        return self._op(
            "inc",
            item,
            item.step,
            (applied, failing),
            increment,
            record,
            _flags(target) + ";" + _flags(failed),
            fp,
            "",
            reasons,
            Report(item.tx_id, item.step, StepStatus.APPLIED),
            StepStatus.FAILED,
        )

    def rollback(self, item: DecisionArrived, fields: Mapping[str, str]) -> Prepared | None:
        """A rollback decision planned on the transaction's ledger hash as read (``fields``):
        the script checks the hash is still that, or leaves the item to the per-step path.
        Only a transaction with no step here (the rollback marker) or one step."""
        if item.outcome is not Outcome.ROLLBACK or not TX_ID.fullmatch(item.tx_id):
            return None
        planned = _planned_on(fields)
        if planned is None:
            return None
        try:
            decoded = {name: entry_of_json(text) for name, text in fields.items()}
        except (ValueError, KeyError, TypeError):
            return None  # the per-step path reports what is wrong with the ledger
        entries = sorted(
            (e for name, e in decoded.items() if step_of_field(name) is not None),
            key=lambda e: e.step,
        )
        if not entries:
            marker = rolled_back_marker(item.tx_id, item.now_ms)
            after = {**decoded, field_of_step(MARKER_STEP): marker}
            return self._put(item, MARKER_STEP, marker, _hash_flags(after), "", planned, None)
        if len(entries) != 1:
            return None
        [entry] = entries
        confirm = entry.action is not None and self.actions.has_confirm(entry.action)
        signal = Decided(item.tx_id, entry.step, item.outcome, item.now_ms, confirm)
        p = plan(entry, False, signal, None)
        target = p.entry
        if p.effect is Effect.NONE:
            emit = _emit(item.tx_id, entry.step, p.emit, target, entry, self.actions)
            if target is None:
                args = _put("", "n-", planned)
                return Prepared(
                    item,
                    item.tx_id,
                    entry.step,
                    (self.keys.tx(item.tx_id),) * 2,
                    (args[0], item.tx_id, "", "", *args[1:]),
                    emit,
                )
            after = {**decoded, field_of_step(entry.step): target}
            return self._put(item, entry.step, target, _hash_flags(after), "", planned, emit)
        if p.effect is not Effect.COMPENSATE or target is None:
            return None
        stuck = replace(target, status=LedgerStatus.COMPENSATION_FAILED)
        parsed = self._parsed(target)
        if isinstance(parsed, BusinessRejection):
            reason = f"compensation failed: {parsed.reason}"
            stuck = replace(stuck, reason=reason)
            after = {**decoded, field_of_step(entry.step): stuck}
            report = Report(item.tx_id, entry.step, StepStatus.COMPENSATION_FAILED, reason)
            return self._put(item, entry.step, stuck, _hash_flags(after), "", planned, report)
        if parsed is None:
            return None
        increment, record = parsed
        old = target.before.get(increment.field) if isinstance(target.before, Mapping) else None
        if increment.by == INT64_MIN or not (old is None or _canonical(old)):
            return None  # Python keeps the old spelling of a number HINCRBY would not
        failing = _halves(replace(stuck, reason=_SPLICE))
        if failing is None:
            return None
        field = field_of_step(entry.step)
        where, name = f"{increment.target}/{increment.key}", increment.field
        head = "compensation failed: "
        reasons = (
            "",
            "",
            "",
            f"{head}{where} no longer exists, so its increment of {name} cannot be undone",
            f"{head}{where} has no value in {name}",
        )
        done_flags = _hash_flags({**decoded, field: target})
        stuck_flags = _hash_flags({**decoded, field: stuck})
        return self._op(
            "dec",
            item,
            entry.step,
            ((entry_json(target), ""), failing),
            replace(increment, by=-increment.by, min=None, max=None),
            record,
            done_flags + ";" + stuck_flags,
            "",
            planned,
            reasons,
            Report(item.tx_id, entry.step, StepStatus.COMPENSATED),
            StepStatus.COMPENSATION_FAILED,
        )

    def _parsed(self, target: LedgerEntry) -> tuple[Increment, str] | BusinessRejection | None:
        """The step's increment and record key, its business rejection, or ``None``."""
        if not builtin_here(self.actions, target.action or ""):
            return None
        try:
            parsed = parse_action(target.action or "", target.args or {}, self.targets)
            if not isinstance(parsed, Increment):
                return None
            return parsed, record_key(self.prefix, parsed.target, parsed.key)
        except BusinessRejection as exc:
            return exc

    def _put(
        self,
        item: WorkItem,
        step: int,
        entry: LedgerEntry,
        flags: str,
        fp: str,
        planned: str,
        emit: Report | None,
    ) -> Prepared:
        ledger = self.keys.tx(item.tx_id)
        args = _put(entry_json(entry), flags, planned)
        return Prepared(
            item,
            item.tx_id,
            step,
            (ledger, ledger),
            (args[0], item.tx_id, field_of_step(step), fp, *args[1:]),
            emit,
        )

    def _op(
        self,
        kind: str,
        item: WorkItem,
        step: int,
        entries: tuple[tuple[str, str], tuple[str, str]],
        increment: Increment,
        record: str,
        flags: str,
        fp: str,
        planned: str,
        reasons: tuple[str, ...],
        done: Report,
        rejected: StepStatus,
    ) -> Prepared | None:
        if not _int64(increment.by) or any("\n" in r for r in reasons):
            return None
        args = (
            kind,
            item.tx_id,
            field_of_step(step),
            fp,
            *entries[0],
            *entries[1],
            increment.field,
            str(increment.by),
            "" if increment.min is None else str(increment.min),
            "" if increment.max is None else str(increment.max),
            flags,
            "\n".join(reasons),
            planned,
        )
        return Prepared(
            item, item.tx_id, step, (self.keys.tx(item.tx_id), record), args, done, rejected
        )


def _emit(
    tx_id: str,
    step: int,
    status: StepStatus | None,
    target: LedgerEntry | None,
    entry: LedgerEntry | None,
    actions: Actions[Any],
) -> Report | None:
    """The report :func:`participants._storage.run_item` makes of a plan without effect."""
    if status is None:
        return None
    reason = target.reason if target is not None else (entry.reason if entry else None)
    if status not in (StepStatus.FAILED, StepStatus.COMPENSATION_FAILED):
        reason = None
    recorded = target if target is not None else entry
    confirm = (
        status is StepStatus.APPLIED
        and recorded is not None
        and recorded.action is not None
        and actions.has_confirm(recorded.action)
    )
    return Report(tx_id, step, status, reason, confirm)


class RedisBatch:
    """Runs a batch's items in order: runs of :class:`Prepared` steps as script calls,
    the rest (and every step a call leaves) through ``slow``, the per-step path."""

    def __init__(self, client: redis.Redis, planner: Planner) -> None:
        self.client = client
        self.planner = planner
        self.script = client.register_script(SCRIPT)

    def run(
        self, items: Sequence[WorkItem], slow: Callable[[WorkItem], list[Report]]
    ) -> list[Report]:
        steps = self._plan(items)
        reports: list[Report] = []
        at = 0
        while at < len(steps):
            step = steps[at]
            if not isinstance(step, Prepared):
                reports.extend(slow(step))
                at += 1
                continue
            run: list[Prepared] = []
            for each in steps[at : at + CHUNK]:
                if not isinstance(each, Prepared):
                    break
                run.append(each)
            done = self._call(run)
            for each, (code, text) in zip(run, done, strict=False):
                reports.extend(_outcome(each, code, text))
            at += len(done)
            if len(done) < len(run):
                reports.extend(slow(run[len(done)].item))  # the script left it: per step
                at += 1
        return reports

    def _plan(self, items: Sequence[WorkItem]) -> list[Prepared | WorkItem]:
        """Each item planned, or left as it is for the per-step path. Rollback decisions
        are planned on their ledger hashes, read in one pipelined round trip."""
        rollbacks = [
            item
            for item in items
            if isinstance(item, DecisionArrived)
            and item.outcome is Outcome.ROLLBACK
            and isinstance(item.tx_id, str)
            and TX_ID.fullmatch(item.tx_id)
        ]
        read: dict[str, dict[str, str]] = {}
        if rollbacks:
            pipe = self.client.pipeline(transaction=False)
            names = sorted({item.tx_id for item in rollbacks})
            for tx_id in names:
                pipe.hgetall(self.planner.keys.tx(tx_id))
            try:
                found = pipe.execute()
            except redis.exceptions.ResponseError:
                found = None  # a ledger key of another type: the per-step path says so
            if found is not None:
                read = {tx: strings(raw) for tx, raw in zip(names, found, strict=True)}
        steps: list[Prepared | WorkItem] = []
        for item in items:
            ready: Prepared | None
            if isinstance(item, DecisionArrived):
                fields = read.get(item.tx_id)
                ready = None if fields is None else self.planner.rollback(item, fields)
            else:
                ready = self.planner.request(item)
            steps.append(item if ready is None else ready)
        return steps

    def _call(self, chunk: Sequence[Prepared]) -> list[tuple[str, str]]:
        keys = [self.planner.keys.in_flight, self.planner.keys.finished]
        args: list[str | int] = [len(chunk), WIDTH]
        for step in chunk:
            keys.extend(step.keys)
            args.extend(step.args)
        raw = cast(list[str], self.script(keys=keys, args=args))
        return list(zip(raw[::2], raw[1::2], strict=True))


def _outcome(step: Prepared, code: str, text: str) -> list[Report]:
    if code == "r":
        return [Report(step.tx_id, step.step, step.rejected, text)]
    return [] if step.emit is None else [step.emit]
