"""The chaos checker on hand-made histories: each kind of breakage lands in its own count.

Pure logic (no services): a clean history must give all zeros, and each broken
variant exactly the counts that describe it, so a checker that never fails (or
one that blames the wrong thing) fails here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

import pytest

from saga.streams import (
    Mode,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepsCommitted,
    StepStatus,
    encode,
)
from saga.streams.kafka import Message, partition_for
from tests.chaos.checker import COUNTS, CheckInput, check
from tests.chaos.log import DeadLetter, DecisionRecord, Delivery, LogView
from tests.chaos.stores import LedgerRow
from tests.chaos.workload import HOT_OPENING, OWN_OPENING, Transfer, openings

pytestmark = pytest.mark.unit

OK = Transfer("t-ok", 0, "sql", "redis", "s0", "d0", 30, "ok", "parallel")
FUNDS = Transfer("t-funds", 1, "redis", "mongo", "s1", "h2", OWN_OPENING + 5, "funds", "parallel")
TRIO = Transfer("t-trio", 2, "mongo", "sql", "ts2", "td2", 7, "ok", "sequential")
POISON = Delivery("p.requests", b"k", b"{oops", "request: invalid JSON", True, 1, 42)


def _status(tx: str, state: SagaState) -> SagaStatus:
    return SagaStatus(tx, "transfer", state, (), None, 0, 0, 0)


def _request(t: Transfer) -> SagaRequest:
    return SagaRequest(t.tx_id, "transfer", Mode(t.mode), (Step("x", "y", {}),), 10, 0)


def clean() -> CheckInput:
    """OK commits, FUNDS rolls back (its debit was rejected), TRIO rolls back before its
    request; every saga finished; the poison record is in the DLQ once."""
    transfers = [OK, FUNDS, TRIO]
    opening = openings(transfers)
    balances = {s: dict(a) for s, a in opening.items()}
    balances["sql"]["s0"] -= 30
    balances["redis"]["d0"] += 30
    outcome = {"t-ok": "commit", "t-funds": "rollback", "t-trio": "rollback"}
    log = LogView()
    log.decisions = defaultdict(list)
    log.events = defaultdict(set)
    for t in transfers:
        log.requests[t.tx_id] = _request(t)
        log.decisions[t.tx_id].append(DecisionRecord(outcome[t.tx_id], False, False, b"d"))
        final = "committed" if outcome[t.tx_id] == "commit" else "compensated"
        for step in (0, 1):
            log.events[(t.tx_id, step)] = {"applied", final}
        state = SagaState.COMMITTED if outcome[t.tx_id] == "commit" else SagaState.ROLLED_BACK
        log.statuses[t.tx_id] = _status(t.tx_id, state)
    log.dlq = [DeadLetter(("p.requests", 1, 42), b"k", b"{oops", "is not valid JSON")]
    ledgers = {
        ("bank-sql", "t-ok", 0): LedgerRow("committed", True),
        ("bank-redis", "t-ok", 1): LedgerRow("committed", True),
        ("bank-redis", "t-funds", 0): LedgerRow("compensated", False),
        ("bank-mongo", "t-funds", 1): LedgerRow("compensated", True),
        ("bank-mongo", "t-trio", 0): LedgerRow("compensated", False),
        ("bank-sql", "t-trio", 1): LedgerRow("compensated", False),
    }
    return CheckInput(
        transfers=transfers,
        acked={t.tx_id: True for t in transfers},
        trio={"t-trio"},
        openings=opening,
        balances=balances,
        ledgers=ledgers,
        log=log,
        poison=[POISON],
    )


def nonzero(inp: CheckInput) -> dict[str, int]:
    return {k: v for k, v in check(inp).counts.items() if v}


def test_a_clean_history_has_no_violation() -> None:
    verdict = check(clean())
    assert verdict.counts == dict.fromkeys(COUNTS, 0), verdict.examples
    assert verdict.outcomes == {"commit": 1, "rollback": 2}
    assert verdict.history == {"ok": 1, "failed": 2}
    assert verdict.money["opening_total"] == verdict.money["final_total"]
    assert verdict.poison["in_dlq_once"] == 1


def test_a_debit_applied_twice() -> None:
    inp = clean()
    inp.balances["sql"]["s0"] -= 30
    assert nonzero(inp) == {"steps_applied_twice": 1, "money_not_conserved": 1}


def test_a_compensation_applied_twice() -> None:
    inp = clean()
    # FUNDS' credit to the hot account was applied and compensated twice.
    inp.balances["mongo"]["h2"] -= FUNDS.amount
    assert nonzero(inp) == {"money_not_conserved": 1}  # hot accounts: money only
    inp = clean()
    inp.balances["sql"]["s0"] += 30  # OK's debit undone once too often... after a commit
    assert nonzero(inp) == {"lost_sagas": 1, "money_not_conserved": 1}


def test_a_step_applied_after_its_rollback() -> None:
    inp = clean()
    inp.balances["sql"]["td2"] += TRIO.amount  # the credit of the rolled-back trio saga
    assert nonzero(inp) == {"applied_after_rollback": 1, "money_not_conserved": 1}


def test_a_null_compensation_that_writes() -> None:
    inp = clean()
    inp.balances["mongo"]["ts2"] += TRIO.amount  # "undid" a debit that never happened
    assert nonzero(inp) == {"null_compensation_writes": 1, "money_not_conserved": 1}
    inp = clean()
    inp.balances["sql"]["td2"] -= TRIO.amount  # the same on the credit: below zero too
    assert nonzero(inp) == {
        "null_compensation_writes": 1,
        "money_not_conserved": 1,
        "negative_balances": 1,
    }


def test_two_decisions() -> None:
    inp = clean()
    inp.log.decisions["t-ok"].append(DecisionRecord("rollback", False, False, b"x"))
    assert nonzero(inp) == {"two_decisions": 1}
    inp = clean()
    inp.log.decisions["t-ok"].append(DecisionRecord("commit", False, False, b"y"))
    assert nonzero(inp) == {"two_decisions": 1}  # the coordinator decided twice
    inp = clean()
    inp.log.decisions["t-ok"].append(DecisionRecord("commit", True, False, b"d"))
    inp.log.decisions["t-ok"].append(DecisionRecord("commit", False, True, b"d"))
    assert nonzero(inp) == {}  # a replay and an injected duplicate are copies


def test_lost_and_unfinished_sagas() -> None:
    inp = clean()
    del inp.log.requests["t-ok"]
    inp.log.decisions.pop("t-ok")
    inp.log.statuses.pop("t-ok")
    inp.balances["sql"]["s0"] += 30
    inp.balances["redis"]["d0"] -= 30
    assert nonzero(inp) == {"lost_sagas": 1, "unfinished_sagas": 1}
    unacked = clean()
    del unacked.log.requests["t-ok"]
    unacked.acked = {**unacked.acked, "t-ok": None}  # never acknowledged: not lost
    unacked.log.decisions.pop("t-ok")
    unacked.balances["sql"]["s0"] += 30
    unacked.balances["redis"]["d0"] -= 30
    assert nonzero(unacked) == {}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"decisions": []}, {"unfinished_sagas": 1}),
        ({"events": {"committed", "applied"}}, {}),
        # a committed step with nothing to confirm reports nothing after `applied` ...
        ({"events": {"applied"}}, {}),
        # ... one whose `applied` said confirm must report `committed`
        ({"events": {"applied"}, "confirm": True}, {"unfinished_sagas": 1}),
        ({"events": {"applied", "committed"}, "confirm": True}, {}),
        ({"events": set()}, {"unfinished_sagas": 1}),
        ({"status": SagaState.COMMITTING}, {"unfinished_sagas": 1}),
    ],
)
def test_unfinished_variants(change: dict[str, Any], expected: dict[str, int]) -> None:
    inp = clean()
    if "decisions" in change:
        inp.log.decisions["t-ok"] = change["decisions"]
        # the saga moved money without a decision
        expected = {**expected, "money_not_conserved": 2}
    if "events" in change:
        inp.log.events[("t-ok", 1)] = change["events"]
    if change.get("confirm"):
        inp.log.confirms.add(("t-ok", 1))
    if "status" in change:
        inp.log.statuses["t-ok"] = _status("t-ok", change["status"])
    assert nonzero(inp) == expected


def test_a_saga_finished_only_after_its_recovery_window_counts_as_unfinished() -> None:
    inp = clean()
    inp.late = {"t-ok"}
    assert nonzero(inp) == {"unfinished_sagas": 1}


def test_dead_letters() -> None:
    inp = clean()
    inp.log.dlq = []
    assert nonzero(inp) == {"poison_not_in_dlq_once": 1}
    inp = clean()
    inp.log.dlq = inp.log.dlq * 2
    assert nonzero(inp) == {"poison_not_in_dlq_once": 1}
    inp = clean()
    inp.log.dlq = [replace(inp.log.dlq[0], value=b"changed")]
    assert nonzero(inp) == {"poison_not_in_dlq_once": 1}
    inp = clean()
    inp.log.dlq.append(DeadLetter(("p.events", 0, 7), b"t-ok", b"{}", "rejected"))
    assert nonzero(inp) == {"valid_records_in_dlq": 1}


def test_an_account_created_from_nothing() -> None:
    inp = clean()
    inp.balances["mongo"]["nobody"] = 5
    assert nonzero(inp) == {"money_not_conserved": 1}
    assert HOT_OPENING > OWN_OPENING  # hot accounts never go near zero


def test_forged_records_fail_their_signature_and_duplicates_keep_theirs(tmp_path: Any) -> None:
    """Each forged record of the hostile profile is refused for its signature; a duplicate
    (the original record and headers, plus the run's unsigned mark) is accepted."""
    from saga.streams import decode
    from saga.streams._signing import Keyring, allowed_signers, create_key
    from tests.chaos import poison
    from tests.chaos.log import INJECTED_HEADER

    folder = tmp_path / "keys"
    principals = ["coordinator", "client", "operator", "participant-bank-sql"]
    for p in principals:
        create_key(folder, p)
    create_key(tmp_path / "stranger", "client")
    signers = {p: Keyring.load(folder, p) for p in principals}
    signers["stranger"] = Keyring.load(tmp_path / "stranger", "client")
    topics = {k: f"p.{k}" for k in ("requests", "events", "decisions", "status")}
    verify = Keyring.load(folder)

    records = poison.forged("t-real", 1_000, signers, topics)
    assert len({label for label, *_ in records}) == len(records) == 7
    for label, kind, key, value, headers in records:
        allowed = allowed_signers(decode(value))
        why = verify.check(topics[kind], key.encode(), value, headers, allowed)
        assert why is not None, label

    value = b'{"v":1,"type":"saga.abort","tx_id":"t-real","reason":"r","at_ms":1}'
    signed = signers["client"].sign(topics["requests"], "t-real", value)
    again = [*signed, (INJECTED_HEADER, b"duplicate")]
    allowed = allowed_signers(decode(value))
    assert verify.check(topics["requests"], b"t-real", value, again, allowed) is None


def _event_message(
    record: StepEvent | StepsCommitted, at: int, *, key: str | None = None, partition: int = 0
) -> Message:
    """``record`` as read from the events topic, written at ``at`` (Kafka's timestamp)."""
    tx = record.tx_id if key is None else key
    return Message("p.events", partition, 0, tx.encode(), encode(record), (), at)


def _applied(tx: str, step: int, at: int) -> Message:
    event = StepEvent(tx, step, "bank-redis", StepStatus.APPLIED, at - 5, confirm=True)
    return _event_message(event, at)


def test_a_step_committed_by_a_saga_committed_record_is_finished() -> None:
    """Steps acknowledged together (one ``saga.committed`` of a participant batch) count
    as each step's ``committed`` event, at the record's Kafka timestamp (``at_ms`` is
    taken when the batch starts); read through the reader of the events topic."""
    inp = clean()
    log = inp.log
    log.events.pop(("t-ok", 0))
    log.events.pop(("t-ok", 1))
    for step in (0, 1):
        assert not log.take_event(_applied("t-ok", step, 100 + step))
    assert nonzero(inp) == {"unfinished_sagas": 1}  # confirm said: `committed` must come
    ack = StepsCommitted("bank-redis", 7, (("t-ok", 0), ("t-ok", 1)))
    assert not log.take_event(_event_message(ack, 150))
    assert nonzero(inp) == {}
    assert log.events[("t-ok", 1)] == {"applied", "committed"}
    assert log.event_ms[("t-ok", 0, "committed")] == log.event_ms[("t-ok", 1, "committed")] == 150
    assert log.acks == 1
    # an old-style `committed` saga.step still counts, and the earliest one is the step's
    old = StepEvent("t-ok", 1, "bank-redis", StepStatus.COMMITTED, 7)
    assert not log.take_event(_event_message(old, 140))
    assert log.event_ms[("t-ok", 1, "committed")] == 140


def test_a_saga_committed_the_coordinator_refuses_commits_nothing(tmp_path: Any) -> None:
    """Keyed other than its first tx, listing a tx of another partition, or signed by
    another participant: the coordinator moves such a record to the DLQ, and the
    checker does not count it as any step's event."""
    from saga.streams._signing import Keyring, create_key

    inp = clean()
    log = inp.log
    log.events.pop(("t-ok", 1))
    assert not log.take_event(_applied("t-ok", 1, 100))
    partitions = 16
    here = partition_for("t-ok", partitions)
    elsewhere = next(
        tx for tx in (f"t-x{i}" for i in range(100)) if partition_for(tx, partitions) != here
    )
    ack = StepsCommitted("bank-redis", 7, (("t-ok", 1),))
    assert not log.take_event(_event_message(ack, 150, key="t-funds"))
    spread = StepsCommitted("bank-redis", 7, (("t-ok", 1), (elsewhere, 0)))
    assert not log.take_event(_event_message(spread, 150, partition=here), None, partitions)

    for p in ("participant-bank-sql", "participant-bank-redis"):
        create_key(tmp_path, p)
    verify = Keyring.load(tmp_path)
    forged = _event_message(ack, 150, partition=here)
    headers = Keyring.load(tmp_path, "participant-bank-sql").sign(
        forged.topic, forged.key, forged.value
    )
    assert log.take_event(replace(forged, headers=tuple(headers)), verify, partitions)
    assert nonzero(inp) == {"unfinished_sagas": 1}
    assert ("t-ok", 1, "committed") not in log.event_ms and log.acks == 0

    headers = Keyring.load(tmp_path, "participant-bank-redis").sign(
        forged.topic, forged.key, forged.value
    )
    assert not log.take_event(replace(forged, headers=tuple(headers)), verify, partitions)
    assert nonzero(inp) == {} and log.acks == 1


def test_the_saga_committed_poison_is_refused_by_the_coordinators_checks() -> None:
    """Each ``saga.committed`` poison record breaks the contract or the partition rule."""
    from saga.streams import InvalidRecord, decode_keyed
    from tests.chaos import poison

    acks = [
        (label, key, value)
        for label, kind, key, value in poison.batch("t", "t-real", 1_000)
        if kind == "events" and "saga.committed" in label
    ]
    assert len(acks) == 2
    for _, key, value in acks:
        with pytest.raises(InvalidRecord):
            decode_keyed((key or "").encode(), value, StepEvent, StepsCommitted)
    assert poison.misplaced_ack("t", "t-real", 1_000, 1) == []
    [(_, kind, key, value)] = poison.misplaced_ack("t", "t-real", 1_000, 8)
    assert kind == "events" and key == "t-real" and value is not None
    record = decode_keyed(key.encode(), value, StepEvent, StepsCommitted)
    assert isinstance(record, StepsCommitted)
    assert {partition_for(tx, 8) for tx, _ in record.steps} != {partition_for("t-real", 8)}
    log = LogView()
    message = Message("p.events", partition_for(key, 8), 0, key.encode(), value, (), 5)
    assert not log.take_event(message, None, 8)
    assert not log.events
