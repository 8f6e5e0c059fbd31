"""The coordinator's timers on the in-memory log: they survive aborted transactions.

A batch fires the timers that are due (deadlines, status refreshes, re-drives of a
stalled decision, the end of a participant's grace) and changes them only when its
Kafka transaction commits (coordinator._timers). Each test runs the service under a
:class:`~streams.testing.Stepper` with a :class:`~streams.testing.ManualClock`,
aborts a transaction with :meth:`~streams.testing.InMemoryLog.fail_next_commit`, and
checks that what the timer was for still happens, on time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from saga.coordinator._chores import Redrive
from saga.coordinator._service import CoordinatorService
from saga.coordinator._timers import due
from saga.streams import (
    Decision,
    KafkaSettings,
    Mode,
    Outcome,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepStatus,
    decode_as,
    encode,
)
from saga.streams.testing import InMemoryLog, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="tm")
TOPICS = SETTINGS.topics


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


@pytest.fixture
def start(log: InMemoryLog, clock: ManualClock) -> Iterator[Any]:
    steppers: list[Stepper] = []

    def started(**options: Any) -> tuple[CoordinatorService, Stepper]:
        service = CoordinatorService(SETTINGS, instance_id="a", clock=clock, log=log, **options)
        stepper = Stepper(log, service.run, stop=service.stop)
        steppers.append(stepper)
        return service, stepper.start()

    yield started
    for stepper in steppers:
        if stepper.running:
            stepper.stop()


def submit(
    log: InMemoryLog, clock: ManualClock, tx: str, timeout_ms: int, *names: str
) -> SagaRequest:
    now = clock()
    request = SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=Mode.PARALLEL,
        steps=tuple(
            Step(name, "increment", {"target": "t", "key": "k", "field": "n", "by": 1})
            for name in (names or ("bank", "shop"))
        ),
        deadline_ms=now + timeout_ms,
        created_ms=now,
    )
    with log.producer() as producer:
        producer.produce(TOPICS.requests, tx, encode(request))
    return request


def report(log: InMemoryLog, clock: ManualClock, tx: str, status: StepStatus, *steps: int) -> None:
    names = ("bank", "shop")
    with log.producer() as producer:
        for s in steps:
            event = StepEvent(tx, s, names[s], status, clock(), None, status is StepStatus.APPLIED)
            producer.produce(TOPICS.events, tx, encode(event))


def decisions(log: InMemoryLog, tx: str) -> list[tuple[Outcome, bool]]:
    """(outcome, re-sent by the coordinator) of every decision record of ``tx``."""
    found = []
    for m in log.records(TOPICS.decisions):
        d = decode_as(m.value, Decision)
        if isinstance(d, Decision) and d.tx_id == tx:
            found.append((d.outcome, m.header("saga.replayed.by") is not None))
    return found


def statuses(log: InMemoryLog, tx: str) -> list[SagaStatus]:
    found = [decode_as(m.value, SagaStatus) for m in log.records(TOPICS.status) if m.value]
    return [s for s in found if isinstance(s, SagaStatus) and s.tx_id == tx]


# ---------------------------------------------------------------- the heap walk


def test_due_lists_the_due_entries_smallest_first_without_changing_the_heap() -> None:
    import heapq
    import random

    rng = random.Random(7)
    heap: list[tuple[int, str]] = []
    for i in range(200):
        heapq.heappush(heap, (rng.randrange(1000), f"t{i}"))
    before = list(heap)
    assert due(heap, 400) == sorted(e for e in heap if e[0] <= 400)
    assert due(heap, 400, limit=3) == sorted(e for e in heap if e[0] <= 400)[:3]
    assert due(heap, -1) == [] and due([], 10) == []
    assert heap == before


# ---------------------------------------------------------------- aborted transactions


def test_an_aborted_transaction_does_not_lose_a_deadline(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    """The batch that rolls the saga back on its deadline aborts: the next one does it.

    Before: the deadline was taken off its heap before the commit, and an abort lost it:
    the saga of a participant gone for good stayed pending until a restart.
    """
    service, stepper = start()
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, 5_000)
    report(log, clock, tx, StepStatus.APPLIED, 0)  # "shop" never answers
    stepper.step()
    clock.advance(5_000)
    log.fail_next_commit()
    stepper.step()  # the deadline's batch: its transaction aborts
    assert service.stats.aborted_transactions == 1 and decisions(log, tx) == []
    stepper.step()  # on time: no clock advance since the deadline
    assert decisions(log, tx) == [(Outcome.ROLLBACK, False)]
    assert statuses(log, tx)[-1].state is SagaState.ROLLING_BACK
    assert "deadline" in (statuses(log, tx)[-1].reason or "")
    stepper.step(2)
    assert len(decisions(log, tx)) == 1


def test_an_aborted_transaction_does_not_lose_a_status_refresh(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    """A kept saga's status is published again every half retention; the refresh whose
    transaction aborts is made by the next batch, not a quarter retention later."""
    service, stepper = start(retention_ms=40_000)
    tx = key_on(1, PARTITIONS)
    submit(log, clock, tx, 3_600_000)  # pending for an hour: kept, so refreshed
    stepper.step()
    assert len(statuses(log, tx)) == 1
    clock.advance(20_000)  # half the retention since it was published; a sweep is due
    log.fail_next_commit()
    stepper.step()
    assert service.stats.aborted_transactions == 1 and len(statuses(log, tx)) == 1
    stepper.step()
    assert len(statuses(log, tx)) == 2 and service.stats.refreshed == 1


# ---------------------------------------------------------------- re-driven decisions


def test_a_stalled_commit_is_sent_again_with_backoff_up_to_the_limit(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    """A participant that dropped the commit never confirms: the coordinator re-sends the
    decision after 1 s, then 2 s and 4 s later (limit 3), routed to that participant."""
    service, stepper = start(redrive=Redrive(after_ms=1_000, limit=3))
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, 60_000)
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)  # both have something to confirm
    stepper.step()
    report(log, clock, tx, StepStatus.COMMITTED, 0)  # "shop" dropped the decision
    stepper.step()
    assert statuses(log, tx)[-1].state is SagaState.COMMITTING
    assert decisions(log, tx) == [(Outcome.COMMIT, False)]
    sent_at = []
    for _ in range(12):
        clock.advance(500)
        stepper.step()
        sent_at.append(len(decisions(log, tx)) - 1)
    # re-sent 1 s, 3 s and 7 s after the last change; no more after the limit
    assert sent_at == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]
    clock.advance(60_000)
    stepper.step(2)
    assert decisions(log, tx) == [(Outcome.COMMIT, False)] + [(Outcome.COMMIT, True)] * 3
    assert service.stats.redriven == 3 and service.stats.decisions == 1
    (family,) = [f for f in service.observer.families() if f.name == "saga_decisions_redriven"]
    assert [s.value for s in family.samples if s.name.endswith("_total")] == [3]
    copies = [m for m in log.records(TOPICS.decisions) if m.header("saga.replayed.by")]
    assert all(m.header("saga.parts") == b"shop" for m in copies), "routed to who confirms"
    report(log, clock, tx, StepStatus.COMMITTED, 1)  # the re-sent decision was acted on
    stepper.step()
    assert statuses(log, tx)[-1].state is SagaState.COMMITTED


def _committing_with_one_report(
    log: InMemoryLog, clock: ManualClock, start: Any, redrive: Redrive
) -> tuple[Stepper, str]:
    """A coordinator with ``redrive``, and a saga it decided to commit whose step 1 then
    reported `committed` (step 0 has not)."""
    _, stepper = start(redrive=redrive)
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, 120_000)
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper.step()
    report(log, clock, tx, StepStatus.COMMITTED, 1)
    stepper.step()
    return stepper, tx


def test_a_commit_report_that_leaves_the_saga_committing_is_not_published_and_a_restart_redrives(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    """`shop`'s `committed` report changes the saga in memory but publishes no status (the
    next one, `committed`, says it); a coordinator restored from the status topic does not
    know it, so it sends the decision again at once, not a re-drive period later."""
    stepper, tx = _committing_with_one_report(log, clock, start, Redrive(after_ms=60_000))
    published = statuses(log, tx)
    assert [s.state for s in published] == [SagaState.COMMITTING]  # one batch: one status
    assert [p.status for p in published[-1].steps] == [StepStatus.APPLIED] * 2
    stepper.stop()  # a crash: the report of step 1 is read, its offset committed
    clock.advance(1_000)
    _, again = start(redrive=Redrive(after_ms=60_000))
    again.step()
    assert decisions(log, tx) == [(Outcome.COMMIT, False), (Outcome.COMMIT, True)]
    report(log, clock, tx, StepStatus.COMMITTED, 0, 1)  # both report (again)
    again.step()
    assert statuses(log, tx)[-1].state is SagaState.COMMITTED


def test_a_refused_commit_is_published_while_the_saga_stays_committing(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    """A commit the store refused is parked and reported `compensation_failed`: an operator
    must see it, so its status goes out although the saga stays `committing`."""
    stepper, tx = _committing_with_one_report(log, clock, start, Redrive(after_ms=60_000))
    report(log, clock, tx, StepStatus.COMPENSATION_FAILED, 0)
    stepper.step()
    published = statuses(log, tx)[-1]
    assert published.state is SagaState.COMMITTING
    assert published.steps[0].status is StepStatus.COMPENSATION_FAILED


def test_without_redrives_every_commit_report_is_published(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    _, tx = _committing_with_one_report(log, clock, start, Redrive(after_ms=0))
    published = statuses(log, tx)[-1]
    assert published.state is SagaState.COMMITTING
    assert [p.status for p in published.steps] == [StepStatus.APPLIED, StepStatus.COMMITTED]


def test_progress_starts_the_count_again_and_a_finished_saga_is_not_redriven(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    service, stepper = start(redrive=Redrive(after_ms=1_000, limit=1))
    tx = key_on(1, PARTITIONS)
    submit(log, clock, tx, 60_000)
    report(log, clock, tx, StepStatus.APPLIED, 0)
    report(log, clock, tx, StepStatus.FAILED, 1)
    stepper.step()
    assert decisions(log, tx) == [(Outcome.ROLLBACK, False)]
    clock.advance(1_000)
    stepper.step()
    assert decisions(log, tx)[-1] == (Outcome.ROLLBACK, True)  # the limit: once
    clock.advance(5_000)
    report(log, clock, tx, StepStatus.COMPENSATED, 1)  # progress, not the end yet
    stepper.step()
    clock.advance(999)
    stepper.step()
    assert len(decisions(log, tx)) == 2
    clock.advance(1)
    stepper.step()
    assert len(decisions(log, tx)) == 3  # a new count from the change
    report(log, clock, tx, StepStatus.COMPENSATED, 0)
    stepper.step()
    assert statuses(log, tx)[-1].state is SagaState.ROLLED_BACK
    clock.advance(10_000)
    stepper.step(2)
    assert len(decisions(log, tx)) == 3 and service.stats.redriven == 2


def test_a_redrive_whose_transaction_aborts_is_sent_by_the_next_batch(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    service, stepper = start(redrive=Redrive(after_ms=1_000, limit=2))
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, 60_000)
    report(log, clock, tx, StepStatus.FAILED, 0)
    stepper.step()
    clock.advance(1_000)
    log.fail_next_commit()
    stepper.step()
    assert service.stats.aborted_transactions == 1 and len(decisions(log, tx)) == 1
    stepper.step()
    assert decisions(log, tx) == [(Outcome.ROLLBACK, False), (Outcome.ROLLBACK, True)]
    clock.advance(1_999)
    stepper.step()
    assert len(decisions(log, tx)) == 2
    clock.advance(1)  # the second re-drive is 3 s after the change, whatever the abort
    stepper.step()
    assert len(decisions(log, tx)) == 3 and service.stats.redriven == 2


def test_a_restarted_coordinator_redrives_what_stalled_before_it_started(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    _, stepper = start(redrive=Redrive(after_ms=0))  # off
    tx = key_on(1, PARTITIONS)
    submit(log, clock, tx, 60_000)
    report(log, clock, tx, StepStatus.FAILED, 1)
    stepper.step()
    clock.advance(30_000)
    stepper.step(2)
    assert decisions(log, tx) == [(Outcome.ROLLBACK, False)]
    stepper.stop()
    restarted, stepper = start(redrive=Redrive(after_ms=10_000))
    stepper.step(2)  # restored stalled for 30 s: sent again at once
    assert decisions(log, tx) == [(Outcome.ROLLBACK, False), (Outcome.ROLLBACK, True)]
    assert restarted.stats.restored == 1 and restarted.stats.redriven == 1
