"""End-to-end sagas on real Kafka and PostgreSQL, through real processes.

Two SQL participants share one database schema: ``bank`` owns ``accounts``
and ``shop`` owns ``orders``. Each test gets its own topics and schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from saga.streams import Decision, Outcome, SagaState, Step, StepStatus, encode
from tests._infra import Services, eventually
from tests._system import SagaSystem, balances, bank_system, engine_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema, tmp_path, {"alice": 100, "bob": 50}) as s:
        yield s


def running(system: SagaSystem) -> SagaSystem:
    system.coordinator()
    system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    return system


def orders(system: SagaSystem) -> list[str]:
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text(f'SELECT id FROM "{system.schema}".orders'))]
    finally:
        engine.dispose()


def ledger(system: SagaSystem, tx_id: str) -> dict[tuple[str, int], tuple[str, bool]]:
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f'SELECT participant, step, status, effect FROM "{system.schema}".saga_ledger '
                    "WHERE tx_id = :t"
                ),
                {"t": tx_id},
            )
            return {(r[0], int(r[1])): (r[2], bool(r[3])) for r in rows}
    finally:
        engine.dispose()


def transfer(amount: int, order: str) -> list[Step]:
    return [
        Step(
            "bank",
            "increment",
            {"target": "accounts", "key": "alice", "field": "balance", "by": -amount, "min": 0},
        ),
        Step(
            "shop",
            "insert",
            {"target": "orders", "key": order, "value": {"item": "book", "qty": 1}},
        ),
        Step(
            "bank",
            "increment",
            {"target": "accounts", "key": "bob", "field": "balance", "by": amount},
        ),
    ]


def test_commit_path(system: SagaSystem) -> None:
    """Every step applied -> commit -> the saga and its steps show committed; the stores
    show the change once. Built-in steps at read_committed (the default) confirm: each
    `applied` event says so, the commit writes what they held, and each reports `committed`."""
    running(system)
    with system.client() as client:
        tx = client.submit(transfer(30, "o-1"), saga="transfer", timeout=60)
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.COMMITTED, final
    assert [s.status for s in final.steps] == [StepStatus.COMMITTED] * 3
    assert balances(system) == {"alice": 70, "bob": 80}
    assert orders(system) == ["o-1"]
    assert set(ledger(system, tx).values()) == {("committed", True)}
    assert [d.outcome for d in system.decisions(tx)] == [Outcome.COMMIT]
    events = system.events(tx)
    statuses = sorted(e.status for e in events)
    assert statuses == sorted([StepStatus.APPLIED, StepStatus.COMMITTED] * 3)
    assert all(e.confirm for e in events if e.status is StepStatus.APPLIED)


def test_business_rejection_rolls_back_and_compensates(system: SagaSystem) -> None:
    """A step below its minimum fails; the applied steps are compensated; stores unchanged."""
    running(system)
    with system.client() as client:
        tx = client.submit(transfer(1000, "o-2"), saga="transfer", timeout=60)
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.ROLLED_BACK, final
    assert final.reason is not None and final.reason.startswith("step 0 failed")
    assert balances(system) == {"alice": 100, "bob": 50}
    assert orders(system) == []
    assert [d.outcome for d in system.decisions(tx)] == [Outcome.ROLLBACK]


def test_deadline_rolls_back(system: SagaSystem) -> None:
    """A participant that is down past the deadline: rollback, and its late request is refused."""
    system.coordinator()
    system.participant("bank", ["accounts"])
    with system.client() as client:
        tx = client.submit(transfer(10, "o-3"), saga="transfer", timeout=3)
        eventually(
            lambda: (s := client.status(tx)) is not None and s.state is SagaState.ROLLING_BACK,
            timeout=60,
            message="the deadline did not roll the saga back",
        )
        system.participant("shop", ["orders"])  # comes back after the deadline
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.ROLLED_BACK
    assert final.reason == "deadline passed"
    assert balances(system) == {"alice": 100, "bob": 50}
    assert orders(system) == []
    assert ("shop", 1) in ledger(system, tx)
    assert ledger(system, tx)[("shop", 1)][1] is False  # never took effect


def test_sequential_order_and_reverse_compensation(system: SagaSystem) -> None:
    """Sequential: steps apply in order; on rollback compensation runs in reverse order."""
    running(system)
    steps = transfer(10, "o-4")
    steps[2] = Step(
        "bank",
        "increment",
        {"target": "accounts", "key": "bob", "field": "balance", "by": 10, "max": 55},
    )
    with system.client() as client:
        tx = client.submit(steps, saga="transfer", mode="sequential", timeout=60)
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.ROLLED_BACK, final
    events = system.events(tx)
    applied = [e.step for e in events if e.status is StepStatus.APPLIED]
    assert applied == [0, 1], events
    compensated = [e.step for e in events if e.status is StepStatus.COMPENSATED]
    # step 2 failed (nothing to undo), then 1 before 0
    assert compensated.index(1) < compensated.index(0), events
    assert balances(system) == {"alice": 100, "bob": 50}
    assert orders(system) == []


def test_sequential_commit(system: SagaSystem) -> None:
    running(system)
    with system.client() as client:
        tx = client.submit(transfer(5, "o-5"), saga="transfer", mode="sequential", timeout=60)
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.COMMITTED, final
    applied = [e.step for e in system.events(tx) if e.status is StepStatus.APPLIED]
    assert applied == [0, 1, 2]
    assert balances(system) == {"alice": 95, "bob": 55}


def test_duplicated_request_and_decision_take_effect_once(system: SagaSystem) -> None:
    running(system)
    with system.client() as client:
        request = client.build(transfer(20, "o-6"), saga="transfer", timeout=60)
        client.send(request)
        client.send(request)  # the same request twice
        final = client.result(request.tx_id, timeout=90)
        assert final.state is SagaState.COMMITTED
        decision = system.decisions(request.tx_id)[0]
        producer = system.producer()

        def committed_events() -> int:
            return sum(e.status is StepStatus.COMMITTED for e in system.events(request.tx_id))

        # Built-in steps at read_committed were confirmed by the commit (3 `committed`
        # events); the participants answer a replayed commit, then a replayed request, by
        # reporting each step `committed` again, and write nothing again. One at a time:
        # a participant that reads both in one batch acknowledges each step once.
        producer.produce(system.settings.topics.decisions, decision.tx_id, encode(decision))
        producer.flush(10)
        eventually(lambda: committed_events() >= 6, timeout=60, message="no answer to the commit")
        producer.produce(system.settings.topics.requests, request.tx_id, encode(request))
        producer.flush(10)
        eventually(lambda: committed_events() >= 9, timeout=60, message="no answer to the request")
    assert set(ledger(system, request.tx_id).values()) == {("committed", True)}
    assert balances(system) == {"alice": 80, "bob": 70}
    assert orders(system) == ["o-6"]
    assert len(system.decisions(request.tx_id)) == 2  # the original and our replay


def test_null_compensation_and_hanging_prevention(system: SagaSystem) -> None:
    """A rollback that comes before the request: nothing applied, ever, and it rolls back."""
    running(system)
    with system.client() as client:
        request = client.build(transfer(10, "o-7"), saga="transfer", timeout=60)
        producer = system.producer()
        early = Decision(request.tx_id, Outcome.ROLLBACK, "aborted by operator", request.created_ms)
        producer.produce(system.settings.topics.decisions, request.tx_id, encode(early))
        producer.flush(10)
        # both participants record the rollback before they know their steps
        eventually(
            lambda: len(_markers(system, request.tx_id)) == 2,
            timeout=60,
            message="the participants did not record the early rollback",
            retry_on=(sa.exc.ProgrammingError,),  # the ledger table may not exist yet
        )
        client.send(request)
        final = client.result(request.tx_id, timeout=90)
    assert final.state is SagaState.ROLLED_BACK, final
    assert balances(system) == {"alice": 100, "bob": 50}
    assert orders(system) == []
    assert all(not effect for _, effect in ledger(system, request.tx_id).values())


def _markers(system: SagaSystem, tx_id: str) -> list[str]:
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f'SELECT participant FROM "{system.schema}".saga_ledger '
                    "WHERE tx_id = :t AND step = -1"
                ),
                {"t": tx_id},
            )
            return [r[0] for r in rows]
    finally:
        engine.dispose()


def test_abort_before_decision(system: SagaSystem) -> None:
    """An operator abort rolls back a saga that is waiting on a stopped participant."""
    system.coordinator()
    system.participant("bank", ["accounts"])
    with system.client() as client:
        tx = client.submit(transfer(10, "o-8"), saga="transfer", timeout=120)
        eventually(
            lambda: (
                (s := client.status(tx)) is not None and s.steps[0].status is StepStatus.APPLIED
            ),
            timeout=60,
            message="step 0 was not applied",
        )
        client.abort(tx, "customer cancelled")
        system.participant("shop", ["orders"])
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.ROLLED_BACK
    assert final.reason == "aborted by operator: customer cancelled"
    assert balances(system) == {"alice": 100, "bob": 50}
