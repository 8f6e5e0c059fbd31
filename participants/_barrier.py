"""The barrier: what a participant does with one signal about one of its steps.

A pure function of the step's ledger entry and the signal, so the guarantees of
docs/architecture.md §4 are decided in one place, tested without services, and shared by every
storage. The storage runs the returned ``Plan`` inside the same local atomic unit
that reads and writes the ledger entry.

Signals about a step ``(tx_id, step)``:

* ``Requested``            the request names this participant for the step;
* ``PredecessorApplied``   (sequential) step ``step - 1`` was applied, so this one may go
  (when it comes before the request, the runtime remembers it and sets
  ``Requested.predecessor_applied``);
* ``Decided``              the coordinator's decision for the transaction;
* ``SuccessorCompensated`` (sequential rollback) step ``step + 1`` is compensated.

Guarantees:

* **idempotency** — a signal already acted on changes nothing; the plan says
  which event to emit again;
* **null compensation** — a rollback for a step never applied changes nothing,
  reports ``compensated`` and closes the step;
* **hanging prevention** — a request for a closed step, or one that arrives
  after its deadline, is never applied;
* **order** — in sequential sagas a step is applied only after its predecessor
  was applied, and compensated only after its successor was compensated;
* **one payload per transaction** — every entry records the fingerprint of the
  request it came from (:meth:`streams.SagaRequest.fingerprint`), and a participant
  that reads a request without a step of its own records a transaction-level
  *seen* marker with it. A request whose fingerprint differs from the one this
  participant knows for the transaction applies nothing and reports nothing (the
  coordinator sends it to the DLQ). Entries written before fingerprints existed
  have none and match every request.

Commit. A step with nothing to confirm (``Decided.confirm`` false: every built-in
action, a custom handler without ``confirm``) is not touched by a commit decision:
its entry stays ``applied`` and nothing is reported (its ``applied`` event said so,
and the coordinator counts it committed when it decides). Only a step with a
confirmation is confirmed, moved to ``committed`` and reported. The ledger therefore
does not tell a committed step from one whose decision has not come: a rollback
decision would still compensate it. That is safe because a transaction gets one
decision, ever (I1, the coordinator's); the entry is kept as long as any decision
may still come (below).

Retention. A finished entry (see :func:`finished_ms`) is removed once
``now >= max(deadline_ms, updated_ms) + retention``. An ``applied`` entry (not
waiting to be compensated) is finished at that time too: its decision is taken by
its deadline at the latest, and the retention must exceed the longest time a
decision may take to reach the participant after the deadline (a coordinator or
participant down for longer than the retention breaks this, as it breaks the
coordinator's own memory of the saga). That keeps the guarantees:
the request of a removed entry has a deadline in the past (``deadline_ms`` is
part of the request, and every copy of it carries the same one), so a duplicate
that arrives after the removal meets the deadline check above and is never
applied (it is recorded ``failed``, and that entry is removed a retention later).
A rollback marker carries no deadline (a decision has none): it is kept a
retention after it was written, which covers requests whose timeout is shorter
than the retention. The coordinator forgets a saga at the same horizon, so a
transaction id may be used again, with any payload, once the retention passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from saga.streams import Isolation, Mode, Outcome, StepStatus


class LedgerStatus(StrEnum):
    WAITING = "waiting"  # sequential: request seen, predecessor not applied yet
    SEEN = "seen"  # the transaction-level marker of a request without a step here
    APPLIED = "applied"
    FAILED = "failed"
    COMMITTED = "committed"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """What a participant remembers of one of its steps.

    ``effect`` is true once the business change took effect (it stays true after
    a compensation undid it: the ledger says the step was applied exactly once).
    ``before`` is the before-image the compensation restores. ``rollback_pending``
    marks a sequential step whose rollback waits for its successor;
    ``successor_compensated`` records that the successor was compensated before
    the rollback reached this step.
    """

    tx_id: str
    step: int
    status: LedgerStatus
    action: str | None = None
    args: Mapping[str, Any] | None = None
    mode: Mode = Mode.PARALLEL
    n_steps: int = 0
    deadline_ms: int = 0
    effect: bool = False
    before: Any = None
    reason: str | None = None
    rollback_pending: bool = False
    successor_compensated: bool = False
    updated_ms: int = 0
    fingerprint: str | None = None  # of the request; None: written before fingerprints


def conflicting(known: str | None, fingerprint: str | None) -> bool:
    """Whether a request with ``fingerprint`` differs from the one recorded as ``known``.

    ``None`` on either side (an entry written before fingerprints, a request
    without one) matches everything.
    """
    return known is not None and fingerprint is not None and known != fingerprint


_FINAL = frozenset(
    {LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED, LedgerStatus.FAILED, LedgerStatus.SEEN}
)


def finished_ms(entry: LedgerEntry) -> int | None:
    """When ``entry``'s transaction finished for this participant, or ``None`` if it has not.

    Final entries (committed, compensated, failed, the transaction-level markers)
    finish at ``max(deadline_ms, updated_ms)``; so does an ``applied`` step, in
    either mode, unless its rollback waits for its successor: its decision comes by
    the deadline (a commit leaves it ``applied``), and the coordinator forgets the
    saga at the same horizon. Waiting steps, steps whose rollback waits for their
    successor and failed compensations (an operator must act) never finish on their
    own; nor does an ``applied`` step of a ``read_committed`` saga, whose hold or
    reservation only its decision releases (retention never drops the hold of an
    open saga). The entry may be removed ``retention`` after this.
    """
    final = entry.status in _FINAL or entry.step < 0
    if not final and entry.status is LedgerStatus.APPLIED:
        final = not entry.rollback_pending and (
            isolation_of(entry.before) is not Isolation.READ_COMMITTED
        )
    return max(entry.deadline_ms, entry.updated_ms) if final else None


# ---------------------------------------------------------------- signals


@dataclass(frozen=True, slots=True)
class Requested:
    tx_id: str
    step: int
    action: str
    args: Mapping[str, Any]
    mode: Mode
    n_steps: int
    deadline_ms: int
    now_ms: int
    predecessor_applied: bool = False  # sequential: step - 1 was seen applied already
    successor_compensated: bool = False  # sequential: step + 1 was seen compensated already
    fingerprint: str | None = None  # of the request (SagaRequest.fingerprint())
    # Set by the runtime when applying this step made the storage raise (not a business
    # rejection): the step is recorded and reported failed without running the action.
    fail_reason: str | None = None
    isolation: Isolation = Isolation.READ_COMMITTED  # the request's level


ISOLATION_KEY = "saga.isolation"
"""The key of a before-image that records the step's isolation level (no field name
can be it: fields are identifiers, without a dot)."""


def level_marker(level: Isolation) -> dict[str, Any] | None:
    """What a step entry's ``before`` holds until the step is applied: its level.

    ``read_committed`` is recorded (its apply returns a before-image with the same
    key); ``none`` needs no mark, since a before-image without it means ``none``.
    """
    return {ISOLATION_KEY: str(level)} if level is Isolation.READ_COMMITTED else None


def isolation_of(before: Any) -> Isolation:
    """The isolation level of a step from its ledger entry's ``before``."""
    if isinstance(before, Mapping) and before.get(ISOLATION_KEY) == "read_committed":
        return Isolation.READ_COMMITTED
    return Isolation.NONE


@dataclass(frozen=True, slots=True)
class PredecessorApplied:
    tx_id: str
    step: int  # this participant's step, whose predecessor was applied
    now_ms: int


@dataclass(frozen=True, slots=True)
class Decided:
    """The decision for the step's transaction. ``confirm``: the step's action has
    something to confirm (a commit of a step without is not acted on)."""

    tx_id: str
    step: int
    outcome: Outcome
    now_ms: int
    confirm: bool = True


@dataclass(frozen=True, slots=True)
class SuccessorCompensated:
    tx_id: str
    step: int  # this participant's step, whose successor was compensated
    now_ms: int


Signal = Requested | PredecessorApplied | Decided | SuccessorCompensated


# ---------------------------------------------------------------- plans


class Effect(StrEnum):
    """What the storage must do to its business data."""

    NONE = "none"
    APPLY = "apply"  # run the action (try); on a business rejection write FAILED instead
    CONFIRM = "confirm"  # run the custom confirm, if any
    COMPENSATE = "compensate"  # undo the change from the before-image (or custom cancel)


@dataclass(frozen=True, slots=True)
class Plan:
    """The barrier's answer: the business effect, the ledger entry to write, the event to emit.

    ``entry`` is ``None`` when the ledger must not change. ``emit`` is the step
    status to report (``None``: report nothing yet). For ``Effect.APPLY`` the
    entry is the one to write when the action succeeds; the storage writes
    ``failed`` (and emits ``failed``) when it is rejected.
    """

    effect: Effect
    entry: LedgerEntry | None
    emit: StepStatus | None
    note: str | None = None


_REEMIT = {
    LedgerStatus.APPLIED: StepStatus.APPLIED,
    LedgerStatus.FAILED: StepStatus.FAILED,
    LedgerStatus.COMMITTED: StepStatus.COMMITTED,
    LedgerStatus.COMPENSATED: StepStatus.COMPENSATED,
    LedgerStatus.COMPENSATION_FAILED: StepStatus.COMPENSATION_FAILED,
}


def _nothing(note: str | None = None) -> Plan:
    return Plan(Effect.NONE, None, None, note)


def _reemit(entry: LedgerEntry) -> Plan:
    return Plan(Effect.NONE, None, _REEMIT.get(entry.status))


def plan(
    entry: LedgerEntry | None,
    tx_rolled_back: bool,
    signal: Signal,
    known_fingerprint: str | None = None,
) -> Plan:
    """Decide what to do with ``signal`` given the step's ledger ``entry``.

    ``tx_rolled_back`` is true when a rollback for the transaction was recorded
    before this participant knew its steps (the transaction-level marker).
    ``known_fingerprint`` is the request fingerprint this participant recorded for
    the transaction (any step entry or the seen marker; ``None``: none recorded).
    """
    if isinstance(signal, Requested):
        if conflicting(known_fingerprint, signal.fingerprint) or conflicting(
            entry.fingerprint if entry is not None else None, signal.fingerprint
        ):
            # Another request of this transaction id was acted on here: this one is a
            # conflicting resubmission, which the coordinator sends to the DLQ.
            return _nothing(
                f"request of {signal.tx_id} with another payload than the one acted on here"
            )
        return _on_request(entry, tx_rolled_back, signal)
    if isinstance(signal, PredecessorApplied):
        return _on_predecessor(entry, signal)
    if isinstance(signal, Decided):
        return _on_decision(entry, signal)
    return _on_successor(entry, signal)


def _entry(
    s: Requested, status: LedgerStatus, reason: str | None = None, *, effect: bool = False
) -> LedgerEntry:
    return LedgerEntry(
        tx_id=s.tx_id,
        step=s.step,
        status=status,
        action=s.action,
        args=s.args,
        mode=s.mode,
        n_steps=s.n_steps,
        deadline_ms=s.deadline_ms,
        effect=effect,
        before=level_marker(s.isolation),
        reason=reason,
        updated_ms=s.now_ms,
        fingerprint=s.fingerprint,
    )


def _on_request(entry: LedgerEntry | None, tx_rolled_back: bool, s: Requested) -> Plan:
    if entry is not None and entry.status is LedgerStatus.WAITING:
        if s.predecessor_applied:
            return _on_predecessor(entry, PredecessorApplied(s.tx_id, s.step, s.now_ms))
        return _nothing("request repeated while waiting for the predecessor")
    if entry is not None:
        return _reemit(entry)  # idempotency: the request was acted on already
    if tx_rolled_back or s.successor_compensated:
        # Hanging prevention: the rollback came first (a compensated successor
        # means one was decided); the step is closed for good.
        closed = _entry(s, LedgerStatus.COMPENSATED, "rolled back before the request arrived")
        return Plan(Effect.NONE, closed, StepStatus.COMPENSATED)
    if s.now_ms > s.deadline_ms:
        failed = _entry(s, LedgerStatus.FAILED, "deadline passed before the step was applied")
        return Plan(Effect.NONE, failed, StepStatus.FAILED)
    if s.mode is Mode.SEQUENTIAL and s.step > 0 and not s.predecessor_applied:
        return Plan(Effect.NONE, _entry(s, LedgerStatus.WAITING), None)
    applied = _entry(s, LedgerStatus.APPLIED, effect=True)
    return Plan(Effect.APPLY, applied, StepStatus.APPLIED)


def _on_predecessor(entry: LedgerEntry | None, s: PredecessorApplied) -> Plan:
    # Without an entry the request has not come yet: the runtime remembers the
    # predecessor and passes ``predecessor_applied`` with the request.
    if entry is None:
        return _nothing()
    if entry.status is not LedgerStatus.WAITING:
        # Idempotency: a repeated signal reports the step again, for a crash between
        # the local commit and the events may have lost the report (the request that
        # opened the step is long committed, so this signal is the only one that comes
        # back). A step waiting for its successor's compensation reports nothing yet.
        return _nothing() if entry.rollback_pending else _reemit(entry)
    if s.now_ms > entry.deadline_ms:
        failed = replace(
            entry,
            status=LedgerStatus.FAILED,
            reason="deadline passed before the step was applied",
            updated_ms=s.now_ms,
        )
        return Plan(Effect.NONE, failed, StepStatus.FAILED)
    applied = replace(entry, status=LedgerStatus.APPLIED, effect=True, updated_ms=s.now_ms)
    return Plan(Effect.APPLY, applied, StepStatus.APPLIED)


def _on_decision(entry: LedgerEntry | None, s: Decided) -> Plan:
    if s.outcome is Outcome.COMMIT:
        if entry is None or entry.status is LedgerStatus.WAITING:
            return _nothing(f"commit of {s.tx_id} step {s.step}, which was never applied here")
        if entry.status is LedgerStatus.APPLIED:
            if not s.confirm:
                return _nothing()  # nothing to confirm: the step stays as it is, unreported
            committed = replace(entry, status=LedgerStatus.COMMITTED, updated_ms=s.now_ms)
            return Plan(Effect.CONFIRM, committed, StepStatus.COMMITTED)
        return _reemit(entry)
    # rollback
    if entry is None or entry.status is LedgerStatus.WAITING:
        # Null compensation: nothing was applied; close the step so a late request is refused.
        base = entry or LedgerEntry(s.tx_id, s.step, LedgerStatus.COMPENSATED)
        closed = replace(
            base,
            status=LedgerStatus.COMPENSATED,
            reason="rolled back before the step was applied",
            updated_ms=s.now_ms,
        )
        return Plan(Effect.NONE, closed, StepStatus.COMPENSATED)
    if entry.status is LedgerStatus.FAILED:
        closed = replace(entry, status=LedgerStatus.COMPENSATED, updated_ms=s.now_ms)
        return Plan(Effect.NONE, closed, StepStatus.COMPENSATED)
    if entry.status is LedgerStatus.APPLIED:
        last = entry.step >= entry.n_steps - 1
        if entry.mode is Mode.SEQUENTIAL and not last and not entry.successor_compensated:
            if entry.rollback_pending:
                return _nothing()
            waiting = replace(entry, rollback_pending=True, updated_ms=s.now_ms)
            return Plan(Effect.NONE, waiting, None)
        return _compensate(entry, s.now_ms)
    if entry.status is LedgerStatus.COMPENSATION_FAILED:
        return _compensate(entry, s.now_ms)  # a replayed rollback retries the compensation
    if entry.status is LedgerStatus.COMMITTED:
        return _nothing(f"rollback of {s.tx_id} step {s.step}, which is already committed")
    return _reemit(entry)


def _compensate(entry: LedgerEntry, now_ms: int) -> Plan:
    done = replace(
        entry, status=LedgerStatus.COMPENSATED, rollback_pending=False, updated_ms=now_ms
    )
    return Plan(Effect.COMPENSATE, done, StepStatus.COMPENSATED)


def _on_successor(entry: LedgerEntry | None, s: SuccessorCompensated) -> Plan:
    if entry is not None and entry.status is LedgerStatus.WAITING:
        # A compensated successor means the saga rolls back: this step, never
        # applied, is closed now so its predecessor's `applied` cannot open it.
        closed = replace(
            entry,
            status=LedgerStatus.COMPENSATED,
            reason="rolled back before the step was applied",
            updated_ms=s.now_ms,
        )
        return Plan(Effect.NONE, closed, StepStatus.COMPENSATED)
    if entry is None:
        return _nothing()
    if entry.status is not LedgerStatus.APPLIED:
        return _reemit(entry)  # idempotency, as in _on_predecessor
    if entry.rollback_pending:
        return _compensate(entry, s.now_ms)
    if entry.successor_compensated:
        return _nothing()
    # The successor's compensation overtook our rollback decision: remember it.
    marked = replace(entry, successor_compensated=True, updated_ms=s.now_ms)
    return Plan(Effect.NONE, marked, None)
