"""The participant barrier (``participants._barrier.plan``), docs/architecture.md §4.

Why this module is over 600 lines: one branch table of ``plan()`` and the one
hypothesis model that checks it end to end belong together; split, a reader would
have to hold both files open to see which branch the model reaches.

Every branch of ``plan()`` is exercised with hand-written signals, then a
hypothesis model runs whole transactions through participants that consume the
three topics the way the runtime does (``participants._runtime`` turns records
into work items, ``participants._storage.run_item`` drives the barrier) and
checks idempotency, null compensation, hanging prevention, order and
exactly-once effect over random interleavings, redeliveries and replays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from saga.participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    Plan,
    PredecessorApplied,
    Requested,
    Signal,
    SuccessorCompensated,
    conflicting,
    finished_ms,
    isolation_of,
    level_marker,
    plan,
)
from saga.streams import Isolation, Mode, Outcome, StepStatus

pytestmark = pytest.mark.unit

TX = "tx-1"
NOW = 1_000
DEADLINE = 10_000
ARGS: Mapping[str, Any] = {"target": "accounts", "key": "alice", "field": "balance", "by": -5}

# ------------------------------------------------------------------ helpers


def requested(
    step: int = 0,
    *,
    mode: Mode = Mode.PARALLEL,
    n: int = 1,
    deadline: int = DEADLINE,
    now: int = NOW,
    pred: bool = False,
    tx: str = TX,
) -> Requested:
    return Requested(
        tx_id=tx,
        step=step,
        action="increment",
        args=ARGS,
        mode=mode,
        n_steps=n,
        deadline_ms=deadline,
        now_ms=now,
        predecessor_applied=pred,
    )


def decided(step: int, outcome: Outcome, now: int = NOW + 100) -> Decided:
    return Decided(TX, step, outcome, now)


def commit(step: int = 0, now: int = NOW + 100) -> Decided:
    return decided(step, Outcome.COMMIT, now)


def rollback(step: int = 0, now: int = NOW + 100) -> Decided:
    return decided(step, Outcome.ROLLBACK, now)


def entry_in(
    status: LedgerStatus,
    step: int = 0,
    *,
    mode: Mode = Mode.PARALLEL,
    n: int = 1,
    deadline: int = DEADLINE,
    **kw: Any,
) -> LedgerEntry:
    """A ledger entry as the barrier would have written it for a request of ``step``."""
    base = LedgerEntry(
        tx_id=TX,
        step=step,
        status=status,
        action="increment",
        args=ARGS,
        mode=mode,
        n_steps=n,
        deadline_ms=deadline,
        effect=status
        in (
            LedgerStatus.APPLIED,
            LedgerStatus.COMMITTED,
            LedgerStatus.COMPENSATED,
            LedgerStatus.COMPENSATION_FAILED,
        ),
        before={"balance": 10} if status is not LedgerStatus.WAITING else None,
        updated_ms=NOW,
    )
    return replace(base, **kw)


def nothing(p: Plan) -> bool:
    return p.effect is Effect.NONE and p.entry is None and p.emit is None


def reported_again(p: Plan, status: StepStatus) -> bool:
    """Nothing changes, and the step's current status is reported once more."""
    return p.effect is Effect.NONE and p.entry is None and p.emit is status


def applied_after_request(**kw: Any) -> LedgerEntry:
    p = plan(None, False, requested(**kw))
    assert p.effect is Effect.APPLY
    assert p.entry is not None
    return replace(p.entry, before={"balance": 10})  # what the storage stores with it


# ------------------------------------------------------------------ Requested


def test_first_request_applies() -> None:
    p = plan(None, False, requested(now=NOW))
    assert p.effect is Effect.APPLY
    assert p.emit is StepStatus.APPLIED
    assert p.entry == LedgerEntry(
        tx_id=TX,
        step=0,
        status=LedgerStatus.APPLIED,
        action="increment",
        args=ARGS,
        mode=Mode.PARALLEL,
        n_steps=1,
        deadline_ms=DEADLINE,
        effect=True,
        before=level_marker(Isolation.READ_COMMITTED),  # the level, until apply replaces it
        reason=None,
        rollback_pending=False,
        successor_compensated=False,
        updated_ms=NOW,
    )
    none = plan(None, False, replace(requested(now=NOW), isolation=Isolation.NONE))
    assert none.entry is not None and none.entry.before is None


def test_request_exactly_at_the_deadline_still_applies() -> None:
    # The participant refuses only *after* the deadline; the coordinator rolls back
    # *at* it. Both can happen, and the compensation then undoes the step.
    p = plan(None, False, requested(now=DEADLINE, deadline=DEADLINE))
    assert p.effect is Effect.APPLY


@pytest.mark.parametrize(
    ("status", "emit"),
    [
        (LedgerStatus.APPLIED, StepStatus.APPLIED),
        (LedgerStatus.FAILED, StepStatus.FAILED),
        (LedgerStatus.COMMITTED, StepStatus.COMMITTED),
        (LedgerStatus.COMPENSATED, StepStatus.COMPENSATED),
        (LedgerStatus.COMPENSATION_FAILED, StepStatus.COMPENSATION_FAILED),
    ],
)
@pytest.mark.parametrize("rolled_back", [False, True])
@pytest.mark.parametrize("late", [False, True])
def test_a_repeated_request_reemits_the_same_status(
    status: LedgerStatus, emit: StepStatus, rolled_back: bool, late: bool
) -> None:
    entry = entry_in(status)
    now = DEADLINE + 1 if late else NOW
    p = plan(entry, rolled_back, requested(now=now))
    assert p.effect is Effect.NONE
    assert p.entry is None
    assert p.emit is emit


def test_a_repeated_request_of_a_sequential_step_waiting_for_its_rollback_reemits_applied() -> None:
    entry = entry_in(LedgerStatus.APPLIED, 0, mode=Mode.SEQUENTIAL, n=3, rollback_pending=True)
    p = plan(entry, False, requested(0, mode=Mode.SEQUENTIAL, n=3))
    assert (p.effect, p.entry, p.emit) == (Effect.NONE, None, StepStatus.APPLIED)


def test_request_after_the_rollback_is_closed_without_effect() -> None:
    p = plan(None, True, requested(now=NOW))
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED
    assert not p.entry.effect
    assert p.entry.action == "increment"
    assert p.entry.reason is not None
    # and a repeat of the request stays closed
    again = plan(p.entry, False, requested(now=NOW + 1))
    assert (again.effect, again.entry, again.emit) == (Effect.NONE, None, StepStatus.COMPENSATED)


@pytest.mark.parametrize(
    "signal",
    [
        requested(now=DEADLINE + 1),
        requested(1, mode=Mode.SEQUENTIAL, n=3),
        requested(1, mode=Mode.SEQUENTIAL, n=3, pred=True),
    ],
    ids=["late", "sequential-waiting", "sequential-ready"],
)
def test_the_rollback_marker_wins_over_everything_else(signal: Requested) -> None:
    p = plan(None, True, signal)
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED


def test_request_after_its_deadline_fails_without_effect() -> None:
    p = plan(None, False, requested(now=DEADLINE + 1))
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.FAILED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.FAILED
    assert not p.entry.effect
    assert p.entry.reason is not None
    assert "deadline" in p.entry.reason


def test_sequential_first_step_applies_at_once() -> None:
    p = plan(None, False, requested(0, mode=Mode.SEQUENTIAL, n=3))
    assert p.effect is Effect.APPLY
    assert p.emit is StepStatus.APPLIED


def test_sequential_step_without_its_predecessor_waits() -> None:
    p = plan(None, False, requested(2, mode=Mode.SEQUENTIAL, n=3))
    assert p.effect is Effect.NONE
    assert p.emit is None
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.WAITING
    assert not p.entry.effect
    assert p.entry.action == "increment"
    assert p.entry.n_steps == 3
    assert p.entry.mode is Mode.SEQUENTIAL


def test_sequential_step_with_its_predecessor_applied_applies() -> None:
    p = plan(None, False, requested(1, mode=Mode.SEQUENTIAL, n=3, pred=True))
    assert p.effect is Effect.APPLY
    assert p.emit is StepStatus.APPLIED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.APPLIED


def test_parallel_step_never_waits() -> None:
    p = plan(None, False, requested(2, mode=Mode.PARALLEL, n=3))
    assert p.effect is Effect.APPLY


def test_a_repeated_request_while_waiting_changes_nothing() -> None:
    waiting = plan(None, False, requested(1, mode=Mode.SEQUENTIAL, n=2)).entry
    p = plan(waiting, False, requested(1, mode=Mode.SEQUENTIAL, n=2))
    assert nothing(p)
    assert p.note is not None


def test_a_repeated_request_that_now_knows_the_predecessor_applies() -> None:
    waiting = plan(None, False, requested(1, mode=Mode.SEQUENTIAL, n=2)).entry
    p = plan(waiting, False, requested(1, mode=Mode.SEQUENTIAL, n=2, now=NOW + 5, pred=True))
    assert p.effect is Effect.APPLY
    assert p.emit is StepStatus.APPLIED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.APPLIED
    assert p.entry.effect
    assert p.entry.updated_ms == NOW + 5


# ------------------------------------------------------------------ PredecessorApplied


def test_predecessor_applied_releases_a_waiting_step() -> None:
    waiting = plan(None, False, requested(1, mode=Mode.SEQUENTIAL, n=2)).entry
    assert waiting is not None
    p = plan(waiting, False, PredecessorApplied(TX, 1, NOW + 7))
    assert p.effect is Effect.APPLY
    assert p.emit is StepStatus.APPLIED
    assert p.entry == replace(waiting, status=LedgerStatus.APPLIED, effect=True, updated_ms=NOW + 7)


def test_predecessor_applied_after_the_deadline_fails_the_waiting_step() -> None:
    waiting = plan(None, False, requested(1, mode=Mode.SEQUENTIAL, n=2)).entry
    p = plan(waiting, False, PredecessorApplied(TX, 1, DEADLINE + 1))
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.FAILED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.FAILED
    assert not p.entry.effect


@pytest.mark.parametrize(
    "status",
    [
        None,
        LedgerStatus.APPLIED,
        LedgerStatus.FAILED,
        LedgerStatus.COMMITTED,
        LedgerStatus.COMPENSATED,
        LedgerStatus.COMPENSATION_FAILED,
    ],
)
def test_predecessor_applied_on_anything_but_waiting_changes_nothing(
    status: LedgerStatus | None,
) -> None:
    """Before the request nothing happens; after, the step is reported again (a crash
    between the local commit and the events may have lost its report, and this signal,
    read again from the events topic, is the only one that comes back)."""
    entry = None if status is None else entry_in(status, 1, mode=Mode.SEQUENTIAL, n=2)
    for rolled_back in (False, True):
        p = plan(entry, rolled_back, PredecessorApplied(TX, 1, NOW))
        if status is None:
            assert nothing(p)
        else:
            assert reported_again(p, StepStatus(str(status))), p


def test_predecessor_applied_on_a_step_waiting_for_its_successor_reports_nothing() -> None:
    entry = replace(entry_in(LedgerStatus.APPLIED, 1, mode=Mode.SEQUENTIAL, n=3),
                    rollback_pending=True)  # fmt: skip
    assert nothing(plan(entry, False, PredecessorApplied(TX, 1, NOW)))


# ------------------------------------------------------------------ commit


def test_commit_on_applied_confirms() -> None:
    entry = applied_after_request()
    p = plan(entry, False, commit(now=NOW + 9))
    assert p.effect is Effect.CONFIRM
    assert p.emit is StepStatus.COMMITTED
    assert p.entry == replace(entry, status=LedgerStatus.COMMITTED, updated_ms=NOW + 9)


@pytest.mark.parametrize("mode", list(Mode))
def test_commit_of_a_step_with_nothing_to_confirm_leaves_it_applied_and_says_nothing(
    mode: Mode,
) -> None:
    entry = entry_in(LedgerStatus.APPLIED, mode=mode)
    signal = replace(commit(now=NOW + 9), confirm=False)
    assert nothing(plan(entry, False, signal))
    # the step is still closed for a repeated request (hanging prevention, idempotency) ...
    again = plan(entry, False, requested(now=NOW + 10))
    assert (again.effect, again.entry, again.emit) == (Effect.NONE, None, StepStatus.APPLIED)
    # ... and finishes at its deadline, so the retention removes it
    assert finished_ms(entry) == max(entry.deadline_ms, entry.updated_ms)


def test_an_applied_read_committed_step_waits_for_its_decision_before_retention() -> None:
    held = replace(entry_in(LedgerStatus.APPLIED), before=level_marker(Isolation.READ_COMMITTED))
    assert isolation_of(held.before) is Isolation.READ_COMMITTED
    assert finished_ms(held) is None  # its hold is released by the decision alone
    done = replace(held, status=LedgerStatus.COMMITTED)
    assert finished_ms(done) == max(done.deadline_ms, done.updated_ms)
    assert level_marker(Isolation.NONE) is None
    assert isolation_of({"balance": 3}) is Isolation.NONE


def test_a_repeated_commit_reemits_committed() -> None:
    p = plan(entry_in(LedgerStatus.COMMITTED), False, commit())
    assert (p.effect, p.entry, p.emit) == (Effect.NONE, None, StepStatus.COMMITTED)


@pytest.mark.parametrize("status", [None, LedgerStatus.WAITING])
def test_commit_on_a_step_never_applied_does_nothing(status: LedgerStatus | None) -> None:
    entry = None if status is None else entry_in(status, 1, mode=Mode.SEQUENTIAL, n=2)
    p = plan(entry, False, commit(1))
    assert nothing(p)
    assert p.note is not None
    assert "never applied" in p.note


@pytest.mark.parametrize(
    ("status", "emit"),
    [
        (LedgerStatus.FAILED, StepStatus.FAILED),
        (LedgerStatus.COMPENSATED, StepStatus.COMPENSATED),
        (LedgerStatus.COMPENSATION_FAILED, StepStatus.COMPENSATION_FAILED),
    ],
)
def test_commit_on_a_closed_step_only_reports_it(status: LedgerStatus, emit: StepStatus) -> None:
    # cannot happen with a correct coordinator; the barrier must still not act
    p = plan(entry_in(status), False, commit())
    assert (p.effect, p.entry, p.emit) == (Effect.NONE, None, emit)


# ------------------------------------------------------------------ rollback


def test_rollback_before_the_request_is_a_null_compensation() -> None:
    p = plan(None, False, rollback(3, now=NOW + 4))
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED
    assert (p.entry.tx_id, p.entry.step) == (TX, 3)
    assert not p.entry.effect
    assert p.entry.updated_ms == NOW + 4
    # the closed step refuses a late request (hanging prevention)
    late = plan(p.entry, False, requested(3, n=4))
    assert (late.effect, late.entry, late.emit) == (Effect.NONE, None, StepStatus.COMPENSATED)


def test_rollback_of_a_waiting_step_closes_it() -> None:
    waiting = plan(None, False, requested(1, mode=Mode.SEQUENTIAL, n=2)).entry
    p = plan(waiting, False, rollback(1))
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED
    assert not p.entry.effect
    # the predecessor arriving afterwards never applies it
    assert reported_again(
        plan(p.entry, False, PredecessorApplied(TX, 1, NOW + 200)), StepStatus.COMPENSATED
    )
    late = plan(p.entry, False, requested(1, mode=Mode.SEQUENTIAL, n=2, pred=True))
    assert late.effect is Effect.NONE
    assert late.emit is StepStatus.COMPENSATED


def test_rollback_of_a_failed_step_reports_compensated_without_effect() -> None:
    failed = entry_in(LedgerStatus.FAILED, effect=False, before=None, reason="rejected")
    p = plan(failed, False, rollback())
    assert p.effect is Effect.NONE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED
    assert not p.entry.effect


def test_rollback_of_an_applied_parallel_step_compensates() -> None:
    entry = applied_after_request(n=3)
    p = plan(entry, False, rollback(now=NOW + 3))
    assert p.effect is Effect.COMPENSATE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry == replace(entry, status=LedgerStatus.COMPENSATED, updated_ms=NOW + 3)
    assert p.entry.effect  # applied once, then undone
    assert p.entry.before == {"balance": 10}  # the compensation needs the before-image


def test_rollback_of_the_last_applied_sequential_step_compensates_at_once() -> None:
    entry = applied_after_request(step=2, mode=Mode.SEQUENTIAL, n=3, pred=True)
    p = plan(entry, False, rollback(2))
    assert p.effect is Effect.COMPENSATE
    assert p.emit is StepStatus.COMPENSATED


def test_rollback_of_an_applied_sequential_step_waits_for_its_successor() -> None:
    entry = applied_after_request(step=0, mode=Mode.SEQUENTIAL, n=3)
    p = plan(entry, False, rollback(0, now=NOW + 10))
    assert p.effect is Effect.NONE
    assert p.emit is None
    assert p.entry == replace(entry, rollback_pending=True, updated_ms=NOW + 10)
    pending = p.entry
    # a repeated rollback while waiting changes nothing
    assert nothing(plan(pending, False, rollback(0, now=NOW + 11)))
    # a repeated request while waiting reports the step as applied still
    again = plan(pending, False, requested(0, mode=Mode.SEQUENTIAL, n=3))
    assert (again.effect, again.entry, again.emit) == (Effect.NONE, None, StepStatus.APPLIED)
    # the successor's compensation releases it
    p = plan(pending, False, SuccessorCompensated(TX, 0, NOW + 20))
    assert p.effect is Effect.COMPENSATE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED
    assert not p.entry.rollback_pending
    assert p.entry.updated_ms == NOW + 20
    # and a redelivered successor event only reports it again
    assert reported_again(
        plan(p.entry, False, SuccessorCompensated(TX, 0, NOW + 21)), StepStatus.COMPENSATED
    )


def test_successor_compensated_before_the_rollback_is_remembered() -> None:
    entry = applied_after_request(step=1, mode=Mode.SEQUENTIAL, n=3, pred=True)
    p = plan(entry, False, SuccessorCompensated(TX, 1, NOW + 30))
    assert p.effect is Effect.NONE
    assert p.emit is None
    assert p.entry == replace(entry, successor_compensated=True, updated_ms=NOW + 30)
    marked = p.entry
    assert nothing(plan(marked, False, SuccessorCompensated(TX, 1, NOW + 31)))
    p = plan(marked, False, rollback(1))
    assert p.effect is Effect.COMPENSATE
    assert p.emit is StepStatus.COMPENSATED


@pytest.mark.parametrize(
    "status",
    [None, LedgerStatus.FAILED, LedgerStatus.COMMITTED, LedgerStatus.COMPENSATED],
)
def test_successor_compensated_on_a_step_not_applied_changes_nothing(
    status: LedgerStatus | None,
) -> None:
    entry = None if status is None else entry_in(status, 0, mode=Mode.SEQUENTIAL, n=2)
    p = plan(entry, False, SuccessorCompensated(TX, 0, NOW))
    if status is None:
        assert nothing(p)
    else:
        assert reported_again(p, StepStatus(str(status))), p


def test_successor_compensated_while_waiting_is_not_lost() -> None:
    # sequential 3 steps, this participant owns step 1: the rollback reached step 2
    # (null-compensated) before it reached us, and step 0 was applied meanwhile.
    seq: dict[str, Any] = {"mode": Mode.SEQUENTIAL, "n": 3}
    entry = plan(None, False, requested(1, **seq)).entry
    assert entry is not None
    assert entry.status is LedgerStatus.WAITING
    emitted: list[StepStatus] = []
    applied = undone = 0
    for signal in (
        SuccessorCompensated(TX, 1, NOW + 1),
        PredecessorApplied(TX, 1, NOW + 2),
        rollback(1, now=NOW + 3),
    ):
        p = plan(entry, False, signal)
        applied += p.effect is Effect.APPLY
        undone += p.effect is Effect.COMPENSATE
        entry = p.entry or entry
        if p.emit is not None:
            emitted.append(p.emit)
    # the rollback must end compensated: either never applied, or undone
    assert emitted[-1] is StepStatus.COMPENSATED
    assert applied == undone


def test_a_repeated_rollback_after_compensated_reemits_compensated() -> None:
    for entry in (
        entry_in(LedgerStatus.COMPENSATED),
        entry_in(LedgerStatus.COMPENSATED, effect=False, before=None),
        entry_in(LedgerStatus.COMPENSATED, 0, mode=Mode.SEQUENTIAL, n=3),
    ):
        p = plan(entry, False, rollback())
        assert (p.effect, p.entry, p.emit) == (Effect.NONE, None, StepStatus.COMPENSATED)


@pytest.mark.parametrize(
    ("mode", "step", "n"),
    [(Mode.PARALLEL, 0, 2), (Mode.SEQUENTIAL, 0, 3), (Mode.SEQUENTIAL, 2, 3)],
)
def test_rollback_after_a_failed_compensation_retries_it(mode: Mode, step: int, n: int) -> None:
    stuck = entry_in(
        LedgerStatus.COMPENSATION_FAILED, step, mode=mode, n=n, reason="compensation failed"
    )
    p = plan(stuck, False, rollback(step, now=NOW + 50))
    assert p.effect is Effect.COMPENSATE
    assert p.emit is StepStatus.COMPENSATED
    assert p.entry is not None
    assert p.entry.status is LedgerStatus.COMPENSATED
    assert p.entry.before == stuck.before


def test_rollback_after_commit_does_nothing() -> None:
    p = plan(entry_in(LedgerStatus.COMMITTED), False, rollback())
    assert nothing(p)
    assert p.note is not None
    assert "already committed" in p.note


def test_plan_is_pure() -> None:
    entry = applied_after_request(step=0, mode=Mode.SEQUENTIAL, n=2)
    snapshot = replace(entry)
    for signal in (
        requested(0, mode=Mode.SEQUENTIAL, n=2),
        PredecessorApplied(TX, 0, NOW),
        commit(),
        rollback(),
        SuccessorCompensated(TX, 0, NOW),
    ):
        assert plan(entry, False, signal) == plan(entry, False, signal)
    assert entry == snapshot


# ------------------------------------------------------------------ fingerprints

FP_A = "a" * 32
FP_B = "b" * 32


@pytest.mark.parametrize(
    ("known", "fingerprint", "conflict"),
    [
        (None, None, False),
        (None, FP_A, False),
        (FP_A, None, False),
        (FP_A, FP_A, False),
        (FP_A, FP_B, True),
    ],
)
def test_only_two_different_fingerprints_conflict(
    known: str | None, fingerprint: str | None, conflict: bool
) -> None:
    assert conflicting(known, fingerprint) is conflict


def test_entries_written_for_a_request_keep_its_fingerprint() -> None:
    s = replace(requested(), fingerprint=FP_A)
    for p in (
        plan(None, False, s),
        plan(None, True, s),
        plan(None, False, replace(s, now_ms=DEADLINE + 1)),
        plan(None, False, replace(s, step=1, n_steps=2, mode=Mode.SEQUENTIAL)),
    ):
        assert p.entry is not None
        assert p.entry.fingerprint == FP_A


@pytest.mark.parametrize("status", list(LedgerStatus))
def test_a_request_with_another_fingerprint_than_its_entry_does_nothing(
    status: LedgerStatus,
) -> None:
    entry = entry_in(status, fingerprint=FP_A)
    other = replace(requested(pred=True), fingerprint=FP_B)
    p = plan(entry, False, other, FP_A)
    assert nothing(p)
    assert p.note is not None
    assert "another payload" in p.note
    assert nothing(plan(entry, False, other))  # the entry's own fingerprint suffices


@pytest.mark.parametrize("rolled_back", [False, True])
@pytest.mark.parametrize("late", [False, True])
def test_a_request_of_a_transaction_known_with_another_fingerprint_does_nothing(
    rolled_back: bool, late: bool
) -> None:
    """No entry for this step, but the transaction is known here (another step, or the
    seen marker of a request without a step here): nothing is applied or reported."""
    s = replace(requested(now=DEADLINE + 1 if late else NOW), fingerprint=FP_B)
    assert nothing(plan(None, rolled_back, s, FP_A))


@pytest.mark.parametrize("status", [LedgerStatus.APPLIED, LedgerStatus.COMMITTED])
def test_the_same_fingerprint_or_none_keeps_todays_behaviour(status: LedgerStatus) -> None:
    entry = entry_in(status, fingerprint=FP_A)
    emit = StepStatus(str(status))
    assert reported_again(plan(entry, False, replace(requested(), fingerprint=FP_A), FP_A), emit)
    assert reported_again(plan(entry, False, requested(), FP_A), emit)  # no fingerprint
    legacy = entry_in(status)  # written before fingerprints
    assert reported_again(plan(legacy, False, replace(requested(), fingerprint=FP_B)), emit)
    first = plan(None, False, replace(requested(), fingerprint=FP_A), FP_A)
    assert first.effect is Effect.APPLY


def test_only_requests_look_at_fingerprints() -> None:
    entry = entry_in(LedgerStatus.APPLIED, fingerprint=FP_A)
    assert plan(entry, False, commit(), FP_B).effect is Effect.CONFIRM
    assert plan(entry, False, rollback(), FP_B).effect is Effect.COMPENSATE


# ------------------------------------------------------------------ retention


@pytest.mark.parametrize(
    ("status", "mode", "kw", "finished"),
    [
        (LedgerStatus.COMMITTED, Mode.PARALLEL, {}, True),
        (LedgerStatus.COMPENSATED, Mode.SEQUENTIAL, {}, True),
        (LedgerStatus.FAILED, Mode.SEQUENTIAL, {}, True),
        (LedgerStatus.APPLIED, Mode.PARALLEL, {}, True),
        (LedgerStatus.APPLIED, Mode.SEQUENTIAL, {}, True),
        (LedgerStatus.APPLIED, Mode.SEQUENTIAL, {"rollback_pending": True}, False),
        (LedgerStatus.WAITING, Mode.SEQUENTIAL, {}, False),
        (LedgerStatus.COMPENSATION_FAILED, Mode.PARALLEL, {}, False),
        (LedgerStatus.SEEN, Mode.PARALLEL, {"step": -2}, True),
        (LedgerStatus.COMPENSATED, Mode.PARALLEL, {"step": -1, "deadline_ms": 0}, True),
    ],
)
def test_an_entry_finishes_at_its_deadline_or_last_update(
    status: LedgerStatus, mode: Mode, kw: dict[str, Any], finished: bool
) -> None:
    entry = entry_in(status, mode=mode, **kw)
    expected = max(entry.deadline_ms, entry.updated_ms) if finished else None
    assert finished_ms(entry) == expected
    late = replace(entry, updated_ms=entry.deadline_ms + 5)
    assert finished_ms(late) == (late.updated_ms if finished else None)


@given(
    status=st.sampled_from(LedgerStatus),
    mode=st.sampled_from(Mode),
    deadline=st.integers(0, 10**12),
    updated=st.integers(0, 10**12),
    retention=st.integers(1, 10**10),
)
def test_a_request_repeated_after_its_entry_was_pruned_is_never_applied(
    status: LedgerStatus, mode: Mode, deadline: int, updated: int, retention: int
) -> None:
    """The safety argument of pruning: once ``now >= finished + retention`` the entry may
    be gone, and the same request then finds no entry, yet its deadline is past."""
    entry = entry_in(status, mode=mode, deadline=deadline, updated_ms=updated)
    finished = finished_ms(entry)
    if finished is None:
        return
    now = finished + retention
    again = requested(mode=mode, deadline=deadline, now=now)
    p = plan(None, False, again)
    assert p.effect is Effect.NONE
    assert p.emit is not StepStatus.APPLIED


# ------------------------------------------------------------------ model

TOPICS = ("requests", "decisions", "events")


@dataclass
class Node:
    """One participant: its ledger and what its runtime remembers."""

    name: int
    steps: list[int]
    skew: int
    ledger: dict[int, LedgerEntry] = field(default_factory=dict)
    marker: bool = False  # the tx-level "rolled back before I knew my steps"
    applied_seen: set[int] = field(default_factory=set)  # runtime._applied_seen
    compensated_seen: set[int] = field(default_factory=set)  # runtime._compensated_seen
    sequential_known: bool = False  # runtime._sequential
    cursor: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOPICS, 0))
    saw_rollback: bool = False
    lost_successor: set[int] = field(default_factory=set)  # see Model.known_bug
    seen: str | None = None  # the seen marker: a request without a step here

    def known(self) -> str | None:
        """``Unit.known_fingerprint``: a step entry's fingerprint, else the seen marker's."""
        found = [e.fingerprint for e in self.ledger.values() if e.fingerprint]
        return found[0] if found else self.seen


@dataclass
class Model:
    n: int
    mode: Mode
    deadline: int
    nodes: list[Node]
    rejects: list[bool]  # per step: the action is a business rejection
    comp_fails: list[bool]  # per step: its first compensation fails
    confirms: list[bool] = field(default_factory=list)  # per step: its action has a confirm
    clock: int = 0
    requests: int = 1  # records on the requests topic (duplicates of one request)
    conflicts: set[int] = field(default_factory=set)  # offsets of requests with another payload
    decisions: list[Outcome] = field(default_factory=list)
    events: list[tuple[int, StepStatus]] = field(default_factory=list)
    outcome: Outcome | None = None
    applied: list[int] = field(default_factory=list)
    undone: list[int] = field(default_factory=list)
    confirmed: list[int] = field(default_factory=list)
    comp_tried: set[int] = field(default_factory=set)
    emitted: dict[int, list[StepStatus]] = field(default_factory=dict)
    known_bug: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.applied = [0] * self.n
        self.undone = [0] * self.n
        self.confirmed = [0] * self.n
        self.emitted = {i: [] for i in range(self.n)}
        self.confirms = self.confirms or [False] * self.n

    def owner(self, step: int) -> Node:
        return next(node for node in self.nodes if step in node.steps)

    # -------------------------------------------------------------- the coordinator

    def coordinate(self) -> None:
        if self.outcome is not None:
            return
        seen = set(self.events)
        if any(s is StepStatus.FAILED for _, s in seen):
            self.decide(Outcome.ROLLBACK)
        elif all((i, StepStatus.APPLIED) in seen for i in range(self.n)):
            self.decide(Outcome.COMMIT)
        elif self.clock >= self.deadline:
            self.decide(Outcome.ROLLBACK)

    def decide(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.decisions.append(outcome)

    # -------------------------------------------------------------- the runtime

    def topic_len(self, topic: str) -> int:
        if topic == "requests":
            return self.requests
        return len(self.decisions) if topic == "decisions" else len(self.events)

    def pending(self, node: Node, topic: str) -> bool:
        return node.cursor[topic] < self.topic_len(topic)

    def deliver(self, node: Node, topic: str) -> None:
        offset = node.cursor[topic]
        node.cursor[topic] += 1
        now = self.clock + node.skew
        if topic == "requests" and offset in self.conflicts:
            self.deliver_conflict(node, now)
        elif topic == "requests":
            if not node.steps and node.known() is None:
                node.seen = FP_A  # run_item for RequestSeen
            items: list[Signal] = [
                Requested(
                    tx_id=TX,
                    step=i,
                    action="increment",
                    args={"step": i},
                    mode=self.mode,
                    n_steps=self.n,
                    deadline_ms=self.deadline,
                    now_ms=now,
                    predecessor_applied=(i - 1) in node.applied_seen,
                    successor_compensated=self.mode is Mode.SEQUENTIAL
                    and (i + 1) in node.compensated_seen,
                    fingerprint=FP_A,
                )
                for i in sorted(node.steps)
            ]
            if self.mode is Mode.SEQUENTIAL:
                node.sequential_known = True
            for item in items:
                self.run_signal(node, node.ledger.get(item.step), item)
        elif topic == "decisions":
            self.decision_arrived(node, self.decisions[offset], now)
        else:
            step, status = self.events[offset]
            if status is StepStatus.APPLIED:
                node.applied_seen.add(step)
                if node.sequential_known:
                    signal: Signal = PredecessorApplied(TX, step + 1, now)
                    self.run_signal(node, node.ledger.get(step + 1), signal)
            elif status is StepStatus.COMPENSATED and step > 0:
                node.compensated_seen.add(step)
                if node.sequential_known:
                    signal = SuccessorCompensated(TX, step - 1, now)
                    self.run_signal(node, node.ledger.get(step - 1), signal)

    def deliver_conflict(self, node: Node, now: int) -> None:
        """A resubmission of the transaction id with another payload: one more step, which
        lands on a participant without a step in the first request when there is one."""
        assert node.known() == FP_A  # the first request is always read first
        steps = [*node.steps, self.n] if not node.steps else node.steps
        for i in steps:
            signal = Requested(
                tx_id=TX,
                step=i,
                action="increment",
                args={"step": i, "other": True},
                mode=self.mode,
                n_steps=self.n + 1,
                deadline_ms=self.deadline + 1_000,
                now_ms=now,
                predecessor_applied=True,
                fingerprint=FP_B,
            )
            entry = node.ledger.get(i)
            p = plan(entry, entry is None and node.marker, signal, node.known())
            assert nothing(p), f"a conflicting request was acted on: {p}"

    def crash(self, node: Node, data: st.DataObject) -> None:
        """The runtime restarts: its memory is rebuilt from the ledger, offsets go back.

        The events topic's committed offset trails by the event window (here: all of
        it); the other topics resume from some earlier committed offset.
        """
        node.applied_seen = set()
        node.compensated_seen = set()
        node.sequential_known = self.mode is Mode.SEQUENTIAL and any(  # in_flight_sequential
            e.status in (LedgerStatus.WAITING, LedgerStatus.APPLIED, LedgerStatus.FAILED)
            for e in node.ledger.values()
        )
        node.cursor["events"] = 0
        for topic in ("requests", "decisions"):
            node.cursor[topic] = data.draw(st.integers(0, node.cursor[topic]))

    def decision_arrived(self, node: Node, outcome: Outcome, now: int) -> None:
        """``run_item`` for ``DecisionArrived``."""
        if outcome is Outcome.ROLLBACK:
            node.saw_rollback = True
        entries = sorted(node.ledger.values(), key=lambda e: e.step)
        if not entries:
            if outcome is Outcome.ROLLBACK:
                node.marker = True
            return
        for entry in entries:
            confirm = self.confirms[entry.step]
            self.run_signal(node, entry, Decided(TX, entry.step, outcome, now, confirm))

    def run_signal(self, node: Node, entry: LedgerEntry | None, signal: Signal) -> None:
        """``_run_signal``, then: a repeated request or decision reports the step again."""
        mark = len(self.emitted.get(signal.step, ()))
        self._run_signal(node, entry, signal)
        if entry is None or signal.step not in node.steps:
            return
        now = node.ledger[signal.step]
        said = self.emitted[signal.step][mark:]
        if now.status is LedgerStatus.WAITING or (
            now.rollback_pending and not isinstance(signal, Requested)
        ):
            assert said == [], (signal, said)
        elif isinstance(signal, Requested) or (
            isinstance(signal, Decided) and entry.status is not LedgerStatus.WAITING
        ):
            if isinstance(signal, Decided) and signal.outcome is Outcome.COMMIT:
                expected = {LedgerStatus.COMMITTED: StepStatus.COMMITTED}.get(now.status)
                if not signal.confirm:  # nothing to confirm: untouched and unreported
                    assert (said, now) == ([], entry), (signal, said, entry, now)
            else:
                expected = StepStatus(str(now.status))
            if expected is not None:
                assert said[-1:] == [expected], (signal, entry.status, now.status, said)

    def _run_signal(self, node: Node, entry: LedgerEntry | None, signal: Signal) -> None:
        """``_run_signal`` with a model storage that counts effects."""
        step = signal.step
        rolled_back = isinstance(signal, Requested) and entry is None and node.marker
        known = node.known() if isinstance(signal, Requested) else None
        if (
            isinstance(signal, SuccessorCompensated)
            and step in node.steps
            and (entry is None or entry.status is LedgerStatus.WAITING)
        ):
            node.lost_successor.add(step)  # the barrier drops it
        p = plan(entry, rolled_back, signal, known)
        target = p.entry
        if p.effect is not Effect.NONE:
            assert target is not None, p
            assert target.action is not None, f"{p.effect} without an action: run_item skips it"
        if target is not None:
            assert (target.tx_id, target.step) == (TX, step)
            assert step in node.steps, f"participant {node.name} wrote step {step} it does not own"
        if p.effect is Effect.APPLY:
            assert target is not None
            self.check_apply(node, step, signal.now_ms)
            if self.rejects[step]:
                failed = replace(target, status=LedgerStatus.FAILED, effect=False, reason="no")
                node.ledger[step] = failed
                self.emit(step, StepStatus.FAILED)
                return
            self.applied[step] += 1
            target = replace(target, before={"undo": step})
        elif p.effect is Effect.COMPENSATE:
            assert target is not None
            self.check_compensate(node, step, target)
            if self.comp_fails[step] and step not in self.comp_tried:
                self.comp_tried.add(step)
                node.ledger[step] = replace(
                    target, status=LedgerStatus.COMPENSATION_FAILED, reason="locked"
                )
                self.emit(step, StepStatus.COMPENSATION_FAILED)
                return
            self.undone[step] += 1
        elif p.effect is Effect.CONFIRM:
            assert self.outcome is Outcome.COMMIT
            assert self.confirms[step], f"step {step} has nothing to confirm"
            assert self.applied[step] == 1
            self.confirmed[step] += 1
        if target is not None:
            node.ledger[step] = target
        if p.emit is not None:
            assert step in node.steps, f"participant {node.name} reports step {step}"
            self.emit(step, p.emit)
        if step in node.steps:
            self.check_counts(step)

    def emit(self, step: int, status: StepStatus) -> None:
        history = self.emitted[step]
        if StepStatus.COMPENSATED in history:
            assert status is StepStatus.COMPENSATED, f"step {step}: {status} after compensated"
        if StepStatus.COMMITTED in history:
            assert status is StepStatus.COMMITTED, f"step {step}: {status} after committed"
        if status is StepStatus.COMMITTED:
            assert self.outcome is Outcome.COMMIT
        if status in (StepStatus.COMPENSATED, StepStatus.COMPENSATION_FAILED):
            assert self.outcome is Outcome.ROLLBACK
        history.append(status)
        self.events.append((step, status))

    # -------------------------------------------------------------- invariants

    def check_apply(self, node: Node, step: int, now: int) -> None:
        # hanging prevention: nothing is applied once this participant saw the rollback,
        # nor after the deadline (by this participant's clock)
        assert not node.saw_rollback, f"step {step} applied after its rollback"
        assert not node.marker
        assert now <= self.deadline, f"step {step} applied after its deadline"
        if self.mode is Mode.SEQUENTIAL and step > 0:
            assert (step - 1, StepStatus.APPLIED) in self.events, (
                f"step {step} before step {step - 1}"
            )
        if step in node.lost_successor:
            self.known_bug.add(step)

    def check_compensate(self, node: Node, step: int, target: LedgerEntry) -> None:
        assert self.outcome is Outcome.ROLLBACK
        assert node.saw_rollback
        assert self.applied[step] == 1, f"step {step} compensated but never applied"
        assert target.before == {"undo": step}, "the before-image was lost"
        if self.mode is Mode.SEQUENTIAL and step < self.n - 1:
            assert (step + 1, StepStatus.COMPENSATED) in self.events, (
                f"step {step} compensated before step {step + 1}"
            )

    def check_counts(self, step: int) -> None:
        assert self.applied[step] <= 1, f"step {step} applied {self.applied[step]} times"
        assert self.undone[step] <= self.applied[step], f"step {step} undone more than applied"
        assert self.confirmed[step] <= 1
        assert not (self.confirmed[step] and self.undone[step])

    # -------------------------------------------------------------- quiescence

    def drain(self) -> None:
        """Deliver everything once, let time pass, replay a decision left half done."""
        for _ in range(500):
            progressed = False
            for node in self.nodes:
                for topic in TOPICS:
                    while self.pending(node, topic):
                        self.deliver(node, topic)
                        progressed = True
            if self.outcome is None:
                self.coordinate()
                if self.outcome is None:
                    self.clock = max(self.clock, self.deadline)
                    self.coordinate()
                continue
            if progressed:
                continue
            # the reconciler replays the decision of a step left compensation_failed
            if any(h and h[-1] is StepStatus.COMPENSATION_FAILED for h in self.emitted.values()):
                self.decisions.append(self.outcome)
                continue
            return
        pytest.fail("the model did not quiesce")

    def check_final(self, *, tolerate_known_bug: bool) -> None:
        assert self.outcome is not None
        stuck = self.stuck_by_known_bug() if tolerate_known_bug else set()
        for step in range(self.n):
            entry = self.owner(step).ledger.get(step)
            last = self.emitted[step][-1] if self.emitted[step] else None
            if self.outcome is Outcome.COMMIT and self.confirms[step]:
                assert entry is not None
                assert entry.status is LedgerStatus.COMMITTED, (step, entry)
                assert self.applied[step] == 1
                assert self.confirmed[step] == 1
                assert self.undone[step] == 0
                assert last is StepStatus.COMMITTED
            elif self.outcome is Outcome.COMMIT:
                # nothing to confirm: the commit left the step applied, and said nothing
                assert entry is not None
                assert entry.status is LedgerStatus.APPLIED, (step, entry)
                assert self.applied[step] == 1
                assert self.confirmed[step] == 0
                assert self.undone[step] == 0
                assert last is StepStatus.APPLIED
                assert StepStatus.COMMITTED not in self.emitted[step]
            elif step in stuck and last is not StepStatus.COMPENSATED:
                # BUG (see test_successor_compensated_while_waiting_is_not_lost): the step
                # waits for a successor event it consumed before it was applied, and the
                # steps before it wait for it.
                assert entry is not None
                assert entry.status is LedgerStatus.APPLIED
                assert entry.rollback_pending or step > min(self.known_bug)
            else:
                assert last is StepStatus.COMPENSATED, (step, self.emitted[step], entry)
                assert entry is not None
                assert entry.status is LedgerStatus.COMPENSATED
                assert self.applied[step] == self.undone[step], step
                assert not entry.rollback_pending

    def stuck_by_known_bug(self) -> set[int]:
        """Steps the known bug may leave waiting: its victims and the steps before them."""
        if not self.known_bug:
            return set()
        return set(range(max(self.known_bug) + 1))


def run_model(data: st.DataObject, *, single: bool) -> Model:
    n = data.draw(st.integers(1, 5), label="steps")
    mode = data.draw(st.sampled_from(Mode), label="mode")
    k = 1 if single else data.draw(st.integers(1, min(3, n)), label="participants")
    owners = data.draw(st.lists(st.integers(0, k - 1), min_size=n, max_size=n), label="owners")
    nodes = [
        Node(
            name=j,
            steps=[i for i in range(n) if owners[i] == j],
            skew=data.draw(st.integers(-40, 40)),
        )
        for j in range(k)
    ]
    rare = st.integers(0, 9).map(lambda x: x == 0)
    model = Model(
        n=n,
        mode=mode,
        deadline=data.draw(st.integers(200, 2_000), label="deadline"),
        nodes=nodes,
        rejects=data.draw(st.lists(rare, min_size=n, max_size=n), label="rejects"),
        comp_fails=data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="comp"),
        confirms=data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="confirms"),
    )
    may_abort = data.draw(st.booleans(), label="operator")
    for _ in range(data.draw(st.integers(0, 80), label="length")):
        model.clock += data.draw(st.integers(0, 60))
        actions: list[tuple[str, int, str]] = [
            ("coordinate", 0, ""),
            ("republish", 0, ""),
            ("conflict", 0, ""),
        ] + [
            ("deliver", j, t)
            for j, node in enumerate(nodes)
            for t in TOPICS
            for _ in range(6)
            if model.pending(node, t)
        ]
        if may_abort and model.outcome is None:
            actions.append(("abort", 0, ""))
        if model.outcome is not None:
            actions.append(("replay", 0, ""))
        actions += [
            ("rewind", j, t) for j, node in enumerate(nodes) for t in TOPICS if node.cursor[t]
        ]
        actions += [("crash", j, "") for j in range(k)]
        kind, j, topic = data.draw(st.sampled_from(actions))
        if kind == "coordinate":
            model.coordinate()
        elif kind == "republish":
            model.requests += 1
        elif kind == "conflict":
            model.conflicts.add(model.requests)
            model.requests += 1
        elif kind == "abort":
            model.decide(Outcome.ROLLBACK)
        elif kind == "replay":
            assert model.outcome is not None
            model.decisions.append(model.outcome)
        elif kind == "crash":
            model.crash(nodes[j], data)
        elif kind == "rewind":
            # a crash before the offset commit: the participant reads again from an older offset
            nodes[j].cursor[topic] = data.draw(st.integers(0, nodes[j].cursor[topic] - 1))
        else:
            model.deliver(nodes[j], topic)
    model.drain()
    return model


def finish(model: Model) -> None:
    model.check_final(tolerate_known_bug=True)
    event(f"{model.mode} {model.outcome}")
    if model.known_bug:
        event("known bug: successor compensation lost")
    # the reconciliation job replays the decision of a saga left unfinished: then every
    # step must be closed, whatever happened before
    model.decisions.append(model.outcome or Outcome.ROLLBACK)
    model.drain()
    model.check_final(tolerate_known_bug=False)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_model_one_participant_owning_every_step(data: st.DataObject) -> None:
    model = run_model(data, single=True)
    assert not model.known_bug  # one participant sees the rollback for all its steps at once
    finish(model)


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_model_several_participants(data: st.DataObject) -> None:
    finish(run_model(data, single=False))


# ------------------------------------------------------------------ model scenarios


def sequential_three(rejects: list[bool] | None = None) -> Model:
    """A sequential saga of three steps, one participant each (a, b, c)."""
    return Model(
        n=3,
        mode=Mode.SEQUENTIAL,
        deadline=10_000,
        nodes=[Node(name=j, steps=[j], skew=0) for j in range(3)],
        rejects=rejects or [False] * 3,
        comp_fails=[False] * 3,
    )


def test_model_sequential_commit_and_rollback_in_order() -> None:
    model = sequential_three()
    model.drain()
    assert model.outcome is Outcome.COMMIT
    model.check_final(tolerate_known_bug=False)

    model = sequential_three(rejects=[False, False, True])
    model.drain()
    assert model.outcome is Outcome.ROLLBACK
    model.check_final(tolerate_known_bug=False)
    # compensations ran in reverse order
    order = [s for s, status in model.events if status is StepStatus.COMPENSATED]
    assert order.index(1) < order.index(0)


def _lose_the_successor_event(model: Model, *, b_saw_request_first: bool) -> None:
    a, b, c = model.nodes
    model.decide(Outcome.ROLLBACK)  # an operator abort
    model.deliver(c, "requests")  # c: step 2 waits for step 1
    model.deliver(c, "decisions")  # c: null compensation -> compensated(2)
    model.deliver(a, "requests")  # a: has not read the decision yet -> applied(0)
    if b_saw_request_first:
        model.deliver(b, "requests")  # b: step 1 waits for step 0
    model.deliver(b, "events")  # compensated(2): closes a waiting step 1, or is remembered
    model.deliver(b, "events")  # applied(0)
    if not b_saw_request_first:
        model.deliver(b, "requests")  # b: successor already compensated -> closes step 1
    assert model.applied == [1, 0, 0]  # step 1 was never applied: the rollback came first
    model.drain()  # everything else is delivered once; no replay


def test_model_a_waiting_step_does_not_lose_its_successors_compensation() -> None:
    model = sequential_three()
    _lose_the_successor_event(model, b_saw_request_first=True)
    model.check_final(tolerate_known_bug=False)


def test_model_a_step_not_yet_requested_does_not_lose_its_successors_compensation() -> None:
    model = sequential_three()
    _lose_the_successor_event(model, b_saw_request_first=False)
    model.check_final(tolerate_known_bug=False)
