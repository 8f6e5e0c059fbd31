"""The Redis batch path's planning: work items turned into script steps, or left to the
per-step path (see :mod:`participants.redis._batch` for the path, and
:mod:`participants.redis._script` for what each kind of step does in the script).

Kinds, by isolation level of the step (its request's, or its ledger entry's ``before``):

* ``none``: ``inc`` (apply an increment), ``dec`` (compensate it);
* ``read_committed``: ``res`` (reserve: escrow), ``cmt`` (a commit decision: add what
  was reserved), ``rel`` (a rollback decision: release it);
* ``put``: only a ledger entry (a plan without a business effect).

A commit decision that changes nothing here (every step ``none``) is answered without
the store (:class:`Done`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final, cast

from saga.participants._actions import (
    READ_COMMITTED_BEFORE,
    Increment,
    is_builtin,
    parse_action,
)
from saga.participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    Plan,
    Requested,
    isolation_of,
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
from saga.participants._storage import (
    Actions,
    DecisionArrived,
    Report,
    StepScope,
    WorkItem,
    scope_of,
)
from saga.participants.redis._actions import RedisActions
from saga.participants.redis._isolation import BOUND_TAIL, COUNTED
from saga.participants.redis._session import record_key, side_key
from saga.participants.redis._unit import TX_ID, finished_here, may_wait
from saga.streams import BusinessRejection, Isolation, Outcome, StepStatus

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

SPLICE: Final = "\u2063saga-splice\u2063"
"""Where the script puts a value into Python's JSON. A step's own values may hold it
too (a key, a fingerprint): :func:`_halves` then finds it twice and the step takes the
per-step path."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """One step ready for the script: the item it came from, the step it reports on,
    its keys (ledger, record, side hash) and arguments, what to report when it is done
    (``"a"``, ``"w"``) and the status of a rejection (``"r"``, with the reason the
    script returns)."""

    item: WorkItem
    tx_id: str
    step: int
    keys: tuple[str, str, str]
    args: tuple[str, ...]
    emit: Report | None
    rejected: StepStatus = StepStatus.FAILED


@dataclass(frozen=True, slots=True)
class Done:
    """An item answered from the ledger hash as read, without writing (a commit decision
    of steps with nothing to confirm): its reports."""

    item: WorkItem
    reports: tuple[Report, ...]


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
    done = finished_here(entry)
    return ("w" if may_wait(entry) else "n") + ("-" if done is None else str(done))


def _hash_flags(fields: Mapping[str, LedgerEntry]) -> str:
    """:func:`_flags` of a whole transaction hash, decoded (as :meth:`RedisUnit.write`
    decides with :func:`~participants.redis._unit.tx_finished_ms` and ``may_wait``)."""
    finished = [finished_here(entry) for entry in fields.values()]
    done = None if None in finished else max(cast(list[int], finished), default=None)
    wait = any(may_wait(e) for name, e in fields.items() if step_of_field(name) is not None)
    return ("w" if wait else "n") + ("-" if done is None else str(done))


def _halves(entry: LedgerEntry) -> tuple[str, str] | None:
    """``entry_json(entry)`` cut where its one :data:`SPLICE` string value stands."""
    parts = entry_json(entry).split(json.dumps(SPLICE))
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


def _reasons(
    would: str, low: str, high: str, missing: str, no_value: str, where: str, tail: str = ""
) -> tuple[str, ...]:
    """The texts the script puts its reasons together from, in the order of its header."""
    return (would, low, high, missing, no_value, where, COUNTED, tail)


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
        view = self.actions.scoped(StepScope(item.tx_id, item.step, item.isolation))
        p = plan(None, False, item, None)
        target = p.entry
        if target is None:
            return None
        fp = item.fingerprint or ""
        if p.effect is Effect.NONE:
            emit = _emit(item.tx_id, item.step, p.emit, target, None, view)
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
        held = item.isolation is Isolation.READ_COMMITTED
        if held:
            done = replace(target, before=dict(READ_COMMITTED_BEFORE))
            applied: tuple[str, str] | None = (entry_json(done), "")
        else:
            done = target
            applied = _halves(replace(target, before={increment.field: SPLICE}))
        failing = _halves(replace(failed, reason=SPLICE))
        if applied is None or failing is None:
            return None
        where, name = f"{increment.target}/{increment.key}", increment.field
        reasons = _reasons(
            f"{where} {name} would be ",
            f", below the minimum {increment.min}",
            f", above the maximum {increment.max}",
            f"{where} does not exist",
            f"{where} has no value in {name}",
            where,
        )
        confirm = view.has_confirm(item.action)
        return self._op(
            "res" if held else "inc",
            item,
            item.step,
            (applied, failing),
            increment,
            record,
            _flags(done) + ";" + _flags(failed),
            fp,
            "",
            reasons,
            Report(item.tx_id, item.step, StepStatus.APPLIED, confirm=confirm),
            StepStatus.FAILED,
        )

    def decision(self, item: DecisionArrived, fields: Mapping[str, str]) -> Prepared | Done | None:
        """A decision planned on the transaction's ledger hash as read (``fields``): the
        script checks the hash is still that, or leaves the item to the per-step path.
        A rollback of a transaction with no step here (the rollback marker) or one step;
        a commit of one step, or of steps with nothing to confirm."""
        if not TX_ID.fullmatch(item.tx_id):
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
        plans: list[tuple[LedgerEntry, Plan]] = []
        if item.outcome is Outcome.COMMIT:
            plans = [(entry, self._decided(item, entry)) for entry in entries]
            if all(p.effect is Effect.NONE and p.entry is None for _, p in plans):
                return Done(item, tuple(self._reports(item, plans)))
        elif not entries:
            marker = rolled_back_marker(item.tx_id, item.now_ms)
            after = {**decoded, field_of_step(MARKER_STEP): marker}
            return self._put(item, MARKER_STEP, marker, _hash_flags(after), "", planned, None)
        if len(entries) != 1:
            return None
        [entry] = entries
        p = plans[0][1] if plans else self._decided(item, entry)  # a commit's is planned above
        target = p.entry
        view = self.actions.scoped(scope_of(entry))
        if p.effect is Effect.NONE:
            emit = _emit(item.tx_id, entry.step, p.emit, target, entry, view)
            if target is None:
                args = _put("", "n-", planned)
                ledger = self.keys.tx(item.tx_id)
                return Prepared(
                    item,
                    item.tx_id,
                    entry.step,
                    (ledger, ledger, ledger),
                    (args[0], item.tx_id, "", "", *args[1:]),
                    emit,
                )
            after = {**decoded, field_of_step(entry.step): target}
            return self._put(item, entry.step, target, _hash_flags(after), "", planned, emit)
        if target is None or p.effect not in (Effect.COMPENSATE, Effect.CONFIRM):
            return None
        held = isolation_of(entry.before) is Isolation.READ_COMMITTED
        if held:
            return self._settle(item, entry, target, p.effect, decoded, planned)
        if p.effect is not Effect.COMPENSATE:
            return None
        return self._compensate(item, entry, target, decoded, planned)

    def _decided(self, item: DecisionArrived, entry: LedgerEntry) -> Plan:
        view = self.actions.scoped(scope_of(entry))
        confirm = entry.action is not None and view.has_confirm(entry.action)
        return plan(
            entry, False, Decided(item.tx_id, entry.step, item.outcome, item.now_ms, confirm)
        )

    def _reports(
        self, item: DecisionArrived, plans: list[tuple[LedgerEntry, Plan]]
    ) -> list[Report]:
        reports: list[Report] = []
        for entry, p in plans:
            view = self.actions.scoped(scope_of(entry))
            emit = _emit(item.tx_id, entry.step, p.emit, p.entry, entry, view)
            if emit is not None:
                reports.append(emit)
        return reports

    def _settle(
        self,
        item: DecisionArrived,
        entry: LedgerEntry,
        target: LedgerEntry,
        effect: Effect,
        decoded: Mapping[str, LedgerEntry],
        planned: str,
    ) -> Prepared | None:
        """A ``read_committed`` increment's decision: commit or release its reservation."""
        parsed = self._parsed(target)
        if parsed is None or isinstance(parsed, BusinessRejection):
            return None
        increment, record = parsed
        flags = _hash_flags({**decoded, field_of_step(entry.step): target})
        commit = effect is Effect.CONFIRM
        status = StepStatus.COMMITTED if commit else StepStatus.COMPENSATED
        return self._op(
            "cmt" if commit else "rel",
            item,
            entry.step,
            ((entry_json(target), ""), ("", "")),
            replace(increment, min=None, max=None),
            record,
            flags + ";" + flags,
            "",
            planned,
            ("",) * 8,
            Report(item.tx_id, entry.step, status),
            status,
        )

    def _compensate(
        self,
        item: DecisionArrived,
        entry: LedgerEntry,
        target: LedgerEntry,
        decoded: Mapping[str, LedgerEntry],
        planned: str,
    ) -> Prepared | None:
        """A ``none`` increment's compensation (guarded by the recorded bounds)."""
        stuck = replace(target, status=LedgerStatus.COMPENSATION_FAILED)
        field = field_of_step(entry.step)
        parsed = self._parsed(target)
        if isinstance(parsed, BusinessRejection):
            reason = f"compensation failed: {parsed.reason}"
            stuck = replace(stuck, reason=reason)
            after = {**decoded, field: stuck}
            report = Report(item.tx_id, entry.step, StepStatus.COMPENSATION_FAILED, reason)
            return self._put(item, entry.step, stuck, _hash_flags(after), "", planned, report)
        if parsed is None:
            return None
        increment, record = parsed
        old = target.before.get(increment.field) if isinstance(target.before, Mapping) else None
        if increment.by == INT64_MIN or not (old is None or _canonical(old)):
            return None  # Python keeps the old spelling of a number HINCRBY would not
        failing = _halves(replace(stuck, reason=SPLICE))
        if failing is None:
            return None
        where, name = f"{increment.target}/{increment.key}", increment.field
        head = "compensation failed: "
        reasons = _reasons(
            f"{head}{where} {name} would be ",
            ", below the minimum ",
            ", above the maximum ",
            f"{head}{where} no longer exists, so its increment of {name} cannot be undone",
            f"{head}{where} has no value in {name}",
            where,
            BOUND_TAIL,
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

    def _parsed(
        self, target: LedgerEntry
    ) -> tuple[Increment, tuple[str, str]] | BusinessRejection | None:
        """The step's increment and its record and side keys, its business rejection, or
        ``None``."""
        if not builtin_here(self.actions, target.action or ""):
            return None
        try:
            parsed = parse_action(target.action or "", target.args or {}, self.targets)
            if not isinstance(parsed, Increment):
                return None
            keys = (
                record_key(self.prefix, parsed.target, parsed.key),
                side_key(self.prefix, parsed.target, parsed.key),
            )
            return parsed, keys
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
            (ledger, ledger, ledger),
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
        record: tuple[str, str],
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
        keys = (self.keys.tx(item.tx_id), *record)
        return Prepared(item, item.tx_id, step, keys, args, done, rejected)


def _emit(
    tx_id: str,
    step: int,
    status: StepStatus | None,
    target: LedgerEntry | None,
    entry: LedgerEntry | None,
    actions: Actions[Any],
) -> Report | None:
    """The report :func:`participants._storage.run_item` makes of a plan without effect
    (``actions``: scoped to the step)."""
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
