"""The isolation checker on hand-made histories: each anomaly lands in its own count.

Pure logic (no services): a clean history gives all zeros; each broken variant the
count that names it, so a checker that never fails, or blames the wrong thing,
fails here. Times are ms; decisions at ``lb``, final events at ``ub``.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from saga.streams import Mode, SagaRequest, SagaState, SagaStatus, StepsCommitted, encode
from saga.streams.kafka import Message
from tests.chaos.iso_checker import COUNTS, IsoInput, _subset_sums, check, reason_kind
from tests.chaos.iso_workload import (
    ACCOUNTS,
    OPENING,
    SLOTS,
    IsoSaga,
    increment,
    slot_step,
)
from tests.chaos.log import DeadLetter, DecisionRecord, LogView
from tests.chaos.stores import LedgerRow

pytestmark = pytest.mark.unit

H0 = ("sql", ACCOUNTS, "h0")
H1 = ("redis", ACCOUNTS, "h1")
K0 = ("sql", SLOTS, "k0")
K1 = ("mongo", SLOTS, "k1")

# A commits at 100 (k0 := A, h0 -10, h1 +10), applied by 110; B rolls back at 200
# (k0 := B, h0 -5 were held/reserved, never applied); C commits at 300 (delete k1).
A = IsoSaga("A", "write", "parallel", (
    slot_step("sql", "update", "k0", "A"),
    increment("sql", "h0", -10),
    increment("redis", "h1", 10),
))  # fmt: skip
B = IsoSaga("B", "write", "sequential", (
    slot_step("sql", "update", "k0", "B"), increment("sql", "h0", -5),
))  # fmt: skip
C = IsoSaga("C", "churn", "parallel", (slot_step("mongo", "delete", "k1", "C"),))
OUTCOME = {"A": ("commit", 100, 110), "B": ("rollback", 200, 210), "C": ("commit", 300, 305)}


def clean() -> IsoInput:
    log = LogView()
    ledgers = {}
    for saga in (A, B, C):
        outcome, lb, ub = OUTCOME[saga.tx_id]
        log.requests[saga.tx_id] = SagaRequest(saga.tx_id, "iso", Mode(saga.mode), saga.steps, 0, 0)
        log.decisions[saga.tx_id] = [DecisionRecord(outcome, False, False, b"")]
        log.decided_ms[saga.tx_id] = lb
        log.decision_reasons[saga.tx_id] = "all steps applied"
        final = "committed" if outcome == "commit" else "compensated"
        state = SagaState.COMMITTED if outcome == "commit" else SagaState.ROLLED_BACK
        log.statuses[saga.tx_id] = SagaStatus(saga.tx_id, "iso", state, (), None, 0, 0, 0)
        for i, step in enumerate(saga.steps):
            log.events[(saga.tx_id, i)] = {"applied", final}
            log.confirms.add((saga.tx_id, i))
            log.event_ms[(saga.tx_id, i, "applied")] = lb - 20
            log.event_ms[(saga.tx_id, i, final)] = ub
            ledgers[(step.participant, saga.tx_id, i)] = LedgerRow(final, True)
    samples: dict[tuple[str, str, str], list[tuple[int, int, object]]] = defaultdict(list)
    samples[K0] = [(50, 52, "init"), (102, 104, "init"), (105, 107, "A"), (250, 251, "A")]
    samples[K1] = [(10, 11, "init"), (301, 302, "init"), (400, 401, None)]
    samples[H0] = [(50, 51, OPENING), (103, 104, OPENING - 10), (205, 206, OPENING - 10)]
    samples[H1] = [(105, 106, OPENING), (120, 121, OPENING + 10)]
    return IsoInput(
        sagas=[A, B, C],
        acked={"A": True, "B": True, "C": True},
        log=log,
        samples=dict(samples),  # type: ignore[arg-type]
        final={H0: OPENING - 10, H1: OPENING + 10, K0: "A", K1: None},
        opening_accounts={H0: OPENING, H1: OPENING},
        opening_slots={K0: "init", K1: "init"},
        ledgers=ledgers,
    )


def nonzero(inp: IsoInput) -> dict[str, int]:
    return {k: v for k, v in check(inp).counts.items() if v}


def test_clean_history_has_no_violation() -> None:
    verdict = check(clean())
    assert verdict.counts == dict.fromkeys(COUNTS, 0), verdict.examples
    assert verdict.outcomes == {"commit": 2, "rollback": 1}
    assert verdict.samples == {SLOTS: 7, ACCOUNTS: 5}
    assert verdict.money["final_total"] == verdict.money["expected_total"] == 2 * OPENING


def test_a_rolled_back_writer_seen_is_a_dirty_read() -> None:
    inp = clean()
    inp.samples[K0].insert(3, (206, 207, "B"))  # type: ignore[attr-defined]
    assert nonzero(inp) == {"dirty_reads": 1}


def test_a_committed_writer_seen_before_its_decision_is_a_dirty_read() -> None:
    inp = clean()
    inp.samples[K0][0] = (50, 52, "A")  # type: ignore[index]
    assert nonzero(inp) == {"dirty_reads": 1}


def test_an_old_state_after_a_newer_one_surely_landed_is_a_dirty_read() -> None:
    inp = clean()
    inp.samples[K0].append((260, 261, "init"))  # type: ignore[attr-defined]
    assert nonzero(inp) == {"dirty_reads": 1}


def test_a_record_without_its_field_is_a_dirty_read() -> None:
    inp = clean()
    inp.samples[K1].insert(1, (200, 201, "(a record without a writer)"))  # type: ignore[attr-defined]
    assert nonzero(inp) == {"dirty_reads": 1}


def test_an_uncommitted_increment_seen_is_a_dirty_read() -> None:
    inp = clean()
    inp.samples[H0].append((205, 206, OPENING - 15))  # B's reservation, applied
    assert nonzero(inp) == {"dirty_reads": 1}


def test_an_increment_may_show_while_its_commit_is_in_flight() -> None:
    inp = clean()
    inp.samples[H0].insert(1, (101, 102, OPENING))  # A decided at 100, applied by 110
    inp.samples[H0].insert(2, (102, 103, OPENING - 10))
    assert nonzero(inp) == {}


def test_a_value_outside_the_bounds_is_counted() -> None:
    inp = clean()
    inp.opening_accounts = {H0: 5, H1: OPENING}  # type: ignore[assignment]
    inp.samples[H0] = [(103, 104, -5)]  # type: ignore[index]
    inp.final = {**inp.final, H0: -5}  # type: ignore[dict-item]
    assert nonzero(inp) == {"bound_broken": 2}


def test_a_lost_update_and_lost_money_are_counted() -> None:
    inp = clean()
    inp.final = {**inp.final, K0: "init", H1: OPENING}  # type: ignore[dict-item]
    assert nonzero(inp) == {"lost_updates": 1, "money_not_conserved": 1}


def test_failed_unfinished_ledger_and_dead_letters() -> None:
    inp = clean()
    inp.log.statuses["B"] = SagaStatus("B", "iso", SagaState.FAILED, (), "x", 0, 0, 0)
    inp.log.events[("C", 0)] = {"applied"}  # no committed event for a confirmed step
    inp.ledgers = {**inp.ledgers, ("bank-sql", "A", 1): LedgerRow("compensated", True)}  # type: ignore[dict-item]
    inp.log.dlq += [
        DeadLetter(("requests", 0, 1), b"A", b"{}", "abort of A ignored: it is already decided"),
        DeadLetter(("events", 0, 2), b"A", b"{}", "invalid record"),
    ]
    assert nonzero(inp) == {
        "failed_sagas": 1, "unfinished_sagas": 1, "ledger_disagrees": 1, "records_in_dlq": 1,
    }  # fmt: skip


def test_subset_sums_and_reasons() -> None:
    bits = _subset_sums([3, -2, 5])  # sums from -2: {-2, 0, 1, 3, 5, 6, 8}
    assert {s - 2 for s in range(bits.bit_length()) if bits >> s & 1} == {-2, 0, 1, 3, 5, 6, 8}
    assert reason_kind("step 1 failed: slots/k6 is held by saga x (step 0) until its decision")
    assert reason_kind("aborted by operator: x") == "aborted"
    assert reason_kind("accounts/h0 balance would be -1, below the minimum 0") == "bound (escrow)"


def test_committed_events_from_a_saga_committed_record_bound_the_effect() -> None:
    """A's steps acknowledged by one ``saga.committed`` (a participant's batch): their
    upper bound is the record's Kafka timestamp (110), not its ``at_ms`` (taken when the
    batch began, before the local commit), so A's write read at 105 is no dirty read."""
    inp = clean()
    log = inp.log
    for i in range(len(A.steps)):
        log.events[("A", i)].discard("committed")
        del log.event_ms[("A", i, "committed")]
    assert nonzero(inp) == {"unfinished_sagas": 1}
    ack = StepsCommitted("bank-sql", 95, tuple(("A", i) for i in range(len(A.steps))))
    assert not log.take_event(Message("p.events", 0, 9, b"A", encode(ack), (), 110))
    assert nonzero(inp) == {}
    assert {log.event_ms[("A", i, "committed")] for i in range(len(A.steps))} == {110}
