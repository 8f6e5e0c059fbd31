"""The coordinator service on the in-memory log, one poll at a time (no broker).

Each test starts ``CoordinatorService.run`` under a :class:`streams.testing.Stepper`
(the loop stops at every poll of its group consumer until the test lets it go)
with a :class:`~streams.testing.ManualClock`, writes what clients and participants
would write, and reads what the coordinator published. Covered: commit and
rollback, a rebalance during a batch (the defect of 22df10d: records of a
partition revoked inside the poll that returned them), aborted transactions and
the rewind, restore after restart (tombstones too), deadline ticks, kills before
the commit, fencing, and poison records sent to the DLQ exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest

from saga.coordinator._service import CoordinatorService
from saga.streams import (
    Decision,
    FatalKafkaError,
    KafkaSettings,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepsCommitted,
    StepStatus,
    decode_as,
    encode,
)
from saga.streams.testing import InMemoryLog, KillAt, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="u")
TOPICS = SETTINGS.topics
GROUP = f"{TOPICS.prefix}.coordinator"


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


class Running:
    """Started coordinators; each is stopped (or found dead) at the end of the test."""

    def __init__(self, log: InMemoryLog, clock: ManualClock) -> None:
        self.log = log
        self.clock = clock
        self.steppers: list[Stepper] = []

    def start(self, instance: str = "a", **options: Any) -> tuple[CoordinatorService, Stepper]:
        service = CoordinatorService(
            SETTINGS,
            instance_id=instance,
            clock=self.clock,
            log=self.log,
            **options,
        )
        stepper = Stepper(self.log, service.run, stop=service.stop)
        self.steppers.append(stepper)
        return service, stepper.start()


@pytest.fixture
def coordinators(log: InMemoryLog, clock: ManualClock) -> Iterator[Running]:
    running = Running(log, clock)
    yield running
    for stepper in running.steppers:
        if stepper.running:
            stepper.stop()


# ---------------------------------------------------------------- clients and participants


def tx_on(partition: int, n: int = 0) -> str:
    return key_on(partition, PARTITIONS, n)


def request(tx: str, clock: ManualClock, *, timeout_ms: int = 60_000) -> SagaRequest:
    now = clock()
    return SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=Mode.PARALLEL,
        steps=tuple(
            Step(p, "increment", {"target": "t", "key": "k", "field": "n", "by": 1})
            for p in ("bank", "shop")
        ),
        deadline_ms=now + timeout_ms,
        created_ms=now,
    )


def send(log: InMemoryLog, topic: str, *records: SagaRequest | SagaAbort | StepEvent) -> None:
    with log.producer() as producer:
        for record in records:
            producer.produce(topic, record.tx_id, encode(record))


def submit(log: InMemoryLog, clock: ManualClock, *txs: str, timeout_ms: int = 60_000) -> None:
    send(log, TOPICS.requests, *(request(tx, clock, timeout_ms=timeout_ms) for tx in txs))


def report(
    log: InMemoryLog,
    clock: ManualClock,
    tx: str,
    status: StepStatus,
    *steps: int,
    confirm: bool = False,
) -> None:
    names = ("bank", "shop")
    reason = "no" if status == "failed" else None
    send(
        log,
        TOPICS.events,
        *(StepEvent(tx, s, names[s], status, clock(), reason, confirm) for s in steps),
    )


def decisions(log: InMemoryLog) -> list[tuple[str, Outcome]]:
    found = [decode_as(m.value, Decision) for m in log.records(TOPICS.decisions)]
    return [(d.tx_id, d.outcome) for d in found if isinstance(d, Decision)]


def statuses(log: InMemoryLog) -> dict[str, SagaStatus]:
    """The status topic as a compacted read sees it: latest per key, tombstones remove."""
    latest: dict[str, SagaStatus] = {}
    for m in log.records(TOPICS.status):
        assert m.key is not None
        if m.value is None:
            latest.pop(m.key.decode(), None)
            continue
        status = decode_as(m.value, SagaStatus)
        assert isinstance(status, SagaStatus)
        latest[status.tx_id] = status
    return latest


def state(log: InMemoryLog, tx: str) -> SagaState | None:
    found = statuses(log).get(tx)
    return found.state if found else None


def dead_letters(log: InMemoryLog) -> list[tuple[str, str]]:
    """(source topic and offset, error) of every dead letter."""
    return [
        (
            f"{(m.header('saga.source.topic') or b'').decode()}@"
            f"{(m.header('saga.source.offset') or b'').decode()}",
            (m.header("saga.error") or b"").decode(),
        )
        for m in log.records(TOPICS.dlq)
    ]


class At:
    """Fault hooks that run ``action`` at a point's ``nth`` pass (a rebalance mid-batch...)."""

    def __init__(self, point: str, action: Callable[[], None], nth: int = 1) -> None:
        self.point, self.action, self.nth, self.passes = point, action, nth, 0

    def hit(self, point: str) -> None:
        if point == self.point:
            self.passes += 1
            if self.passes == self.nth:
                self.action()

    def unsafe(self, switch: str) -> bool:
        return False


# ---------------------------------------------------------------- commit and rollback


def test_all_steps_applied_commit_and_the_offsets_commit_with_the_decision(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    tx = tx_on(1)
    submit(log, clock, tx)
    stepper.step()
    assert state(log, tx) is SagaState.PENDING and decisions(log) == []
    report(log, clock, tx, StepStatus.APPLIED, 0)
    report(log, clock, tx, StepStatus.APPLIED, 1, confirm=True)
    stepper.step()
    assert decisions(log) == [(tx, Outcome.COMMIT)]
    assert state(log, tx) is SagaState.COMMITTING  # step 1 has something to confirm
    report(log, clock, tx, StepStatus.COMMITTED, 1)
    stepper.step()
    assert state(log, tx) is SagaState.COMMITTED
    assert log.committed_offset(GROUP, TOPICS.requests, 1) == 1
    assert log.committed_offset(GROUP, TOPICS.events, 1) == log.end_offset(TOPICS.events, 1)
    assert (service.stats.commits, service.stats.rollbacks, service.stats.dlq) == (1, 0, 0)


def test_a_commit_with_nothing_to_confirm_writes_its_decision_and_final_status_together(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """The records a two-step saga costs the coordinator: a status for the request's
    batch, then, in the batch that reads the last `applied`, the decision and the
    `committed` status in one transaction (one status per saga per batch)."""
    _, stepper = coordinators.start()
    tx = tx_on(0)
    submit(log, clock, tx)
    stepper.step()
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper.step()
    assert decisions(log) == [(tx, Outcome.COMMIT)]
    written = [
        decode_as(m.value, SagaStatus) for m in log.records(TOPICS.status) if m.key == tx.encode()
    ]
    assert [cast(SagaStatus, s).state for s in written] == [
        SagaState.PENDING,
        SagaState.COMMITTED,
    ]
    assert [p.status for p in cast(SagaStatus, written[-1]).steps] == [StepStatus.COMMITTED] * 2
    # a `committed` event of an older participant changes nothing and writes nothing
    report(log, clock, tx, StepStatus.COMMITTED, 0, 1)
    stepper.step()
    assert len([m for m in log.records(TOPICS.status) if m.key == tx.encode()]) == 2


def acknowledge(
    log: InMemoryLog, clock: ManualClock, participant: str, *steps: tuple[str, int]
) -> None:
    """A participant's saga.committed for ``steps``, keyed by the first tx_id."""
    ack = StepsCommitted(participant, clock(), steps)
    with log.producer() as producer:
        producer.produce(TOPICS.events, ack.tx_id, encode(ack))


def test_steps_committed_together_count_as_one_committed_event_each(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    first, second, elsewhere = tx_on(0), tx_on(0, 1), tx_on(1)
    submit(log, clock, first, second, elsewhere)
    stepper.step()
    for tx in (first, second, elsewhere):
        report(log, clock, tx, StepStatus.APPLIED, 0, 1, confirm=True)
    stepper.step()
    assert sorted(decisions(log)) == sorted(
        (tx, Outcome.COMMIT) for tx in (first, second, elsewhere)
    )
    assert state(log, first) is SagaState.COMMITTING
    acknowledge(log, clock, "bank", (first, 0), (second, 0))
    acknowledge(log, clock, "shop", (first, 1))
    # one of another partition's transactions among them: the whole record is refused
    acknowledge(log, clock, "shop", (second, 1), (elsewhere, 1))
    # bank speaking for shop's step: ignored (the machine's owner check), not committed
    acknowledge(log, clock, "bank", (elsewhere, 1))
    stepper.step(2)
    assert state(log, first) is SagaState.COMMITTED
    # bank's report is counted (below, shop's alone finishes the saga), but not published
    # while the saga stays committing (coordinator._chores.Chores.unpublished)
    assert state(log, second) is SagaState.COMMITTING
    assert [p.status for p in statuses(log)[second].steps] == [StepStatus.APPLIED] * 2
    assert state(log, elsewhere) is SagaState.COMMITTING
    letters = dead_letters(log)
    assert [error for _, error in letters] == [
        f"saga.committed lists {elsewhere}, whose records belong on another partition"
    ]
    assert service.stats.dlq == 1
    acknowledge(log, clock, "shop", (second, 1))
    acknowledge(log, clock, "shop", (elsewhere, 1))
    acknowledge(log, clock, "bank", (elsewhere, 0))
    stepper.step(2)
    assert {tx: state(log, tx) for tx in (second, elsewhere)} == {
        second: SagaState.COMMITTED,
        elsewhere: SagaState.COMMITTED,
    }


def test_a_failed_step_rolls_back_and_an_abort_before_a_decision_too(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    failing, aborted = tx_on(0), tx_on(1)
    submit(log, clock, failing, aborted)
    report(log, clock, failing, StepStatus.APPLIED, 0)
    report(log, clock, failing, StepStatus.FAILED, 1)
    send(log, TOPICS.requests, SagaAbort(aborted, "operator", clock()))
    stepper.step()
    assert sorted(decisions(log)) == [(failing, Outcome.ROLLBACK), (aborted, Outcome.ROLLBACK)]
    report(log, clock, failing, StepStatus.COMPENSATED, 0, 1)
    stepper.step()
    assert state(log, failing) is SagaState.ROLLED_BACK
    assert state(log, aborted) is SagaState.ROLLING_BACK
    assert service.stats.rollbacks == 2


# ---------------------------------------------------------------- rebalances


def test_records_of_a_partition_revoked_in_the_poll_that_returned_them_go_to_its_new_owner(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """22df10d: such records were skipped but their offsets committed: never decided.

    A owns both partitions. B joins; A's next poll fetches from both, then runs the
    rebalance that leaves A partition 0 only, and returns what it fetched. The request
    on partition 1 must be decided by B, its new owner.
    """
    log.fetch_before_rebalance = True
    a, stepper_a = coordinators.start("a")
    stepper_a.step()  # A owns 0 and 1
    kept, moved = tx_on(0), tx_on(1)
    submit(log, clock, kept, moved)
    b, stepper_b = coordinators.start("b")  # joined: A rebalances at its next poll
    stepper_a.step()
    assert a.sagas_in_memory == 1  # the request of partition 1 was left to B
    stepper_b.step()
    report(log, clock, moved, StepStatus.APPLIED, 0, 1)
    report(log, clock, kept, StepStatus.APPLIED, 0, 1)
    stepper_a.step()
    stepper_b.step()
    assert state(log, moved) is SagaState.COMMITTED, "the moved saga stayed undecided"
    assert sorted(decisions(log)) == sorted([(kept, Outcome.COMMIT), (moved, Outcome.COMMIT)])
    assert (a.stats.commits, b.stats.commits) == (1, 1)


def test_a_rebalance_between_read_and_commit_aborts_the_batch_and_nothing_is_lost(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """The broker refuses offsets from a stale generation: the batch is re-read and
    re-decided by whichever instance owns each partition, each saga once."""
    txs = [tx_on(p, n) for p in range(PARTITIONS) for n in range(3)]
    joined: list[Stepper] = []
    a, stepper_a = coordinators.start(
        "a", faults=At("coordinator.after_read", lambda: joined.append(coordinators.start("b")[1]))
    )
    stepper_a.step()
    submit(log, clock, *txs)
    for tx in txs:
        report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper_a.step()  # B joins while A works on the batch: A's commit is refused
    assert a.stats.aborted_transactions == 1 and decisions(log) == []
    (stepper_b,) = joined
    for _ in range(3):
        stepper_a.step()
        stepper_b.step()
    assert sorted(decisions(log)) == sorted((tx, Outcome.COMMIT) for tx in txs)
    assert a.stats.commits == 3 and a.sagas_held == 3  # partition 0
    assert all(state(log, tx) is SagaState.COMMITTED for tx in txs)


# ---------------------------------------------------------------- aborted transactions


def test_an_aborted_transaction_is_rewound_and_decided_the_same_way_once(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    stepper.step()
    txs = [tx_on(0, 0), tx_on(1, 0), tx_on(1, 1)]
    submit(log, clock, *txs)
    report(log, clock, txs[0], StepStatus.APPLIED, 0, 1)
    report(log, clock, txs[1], StepStatus.FAILED, 0)
    send(log, TOPICS.requests, SagaAbort("early-abort", "x", clock()))  # before its request
    log.fail_next_commit()
    stepper.step()
    assert service.stats.aborted_transactions == 1
    assert decisions(log) == [] and statuses(log) == {}
    assert log.committed_offset(GROUP, TOPICS.requests, 1) is None
    stepper.step()
    assert sorted(decisions(log)) == sorted(
        [(txs[0], Outcome.COMMIT), (txs[1], Outcome.ROLLBACK), ("early-abort", Outcome.ROLLBACK)]
    )
    assert state(log, txs[2]) is SagaState.PENDING
    stepper.step(2)
    assert len(decisions(log)) == 3  # not doubled by the re-read
    assert log.committed_offset(GROUP, TOPICS.requests, 1) == log.end_offset(TOPICS.requests, 1)


def test_a_coordinator_killed_before_its_commit_is_replaced_and_decides_once(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    _, stepper = coordinators.start("a", faults=KillAt(log, "coordinator.before_commit"))
    tx = tx_on(1)
    submit(log, clock, tx)
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper.step()
    assert stepper.killed
    assert decisions(log) == []  # produced, in a transaction left open
    again, stepper = coordinators.start("a")  # the same instance id: fences, aborts
    stepper.step()
    assert decisions(log) == [(tx, Outcome.COMMIT)]
    assert again.stats.commits == 1


def test_a_fenced_coordinator_stops_with_a_fatal_error(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    _, old = coordinators.start("a")
    _, new = coordinators.start("a")
    tx = tx_on(0)
    submit(log, clock, tx)
    with pytest.raises(FatalKafkaError, match="fenced"):
        old.step(2)
    new.step(2)
    assert state(log, tx) is SagaState.PENDING


# ---------------------------------------------------------------- restore


def test_a_restarted_coordinator_restores_its_sagas_from_the_status_topic(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start(retention_ms=100_000)
    done, open_ = tx_on(0), tx_on(1)
    submit(log, clock, done, open_, timeout_ms=1_000)
    stepper.step()
    report(log, clock, done, StepStatus.APPLIED, 0, 1, confirm=True)
    report(log, clock, open_, StepStatus.APPLIED, 0)
    stepper.step()
    report(log, clock, done, StepStatus.COMMITTED, 0, 1)
    stepper.step()
    assert state(log, done) is SagaState.COMMITTED
    clock.advance(200_000)  # past both deadlines and, for done, the retention
    stepper.step()
    assert done not in statuses(log)  # forgotten: a tombstone
    assert state(log, open_) is SagaState.ROLLING_BACK  # its deadline passed
    assert service.stats.forgotten == 1
    stepper.stop()

    restarted, stepper = coordinators.start(retention_ms=100_000)
    assert restarted.stats.restored == 0  # partitions arrive in the first poll
    stepper.step()
    assert restarted.stats.restored == 1 and restarted.sagas_in_memory == 1
    assert sorted(decisions(log)) == [(done, Outcome.COMMIT), (open_, Outcome.ROLLBACK)]
    report(log, clock, open_, StepStatus.COMPENSATED, 0, 1)
    stepper.step()
    assert state(log, open_) is SagaState.ROLLED_BACK


def test_a_restored_pending_saga_keeps_its_reported_steps(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    _, stepper = coordinators.start()
    tx = tx_on(1)
    submit(log, clock, tx)
    report(log, clock, tx, StepStatus.APPLIED, 0)
    stepper.step()
    stepper.stop()
    restarted, stepper = coordinators.start()
    report(log, clock, tx, StepStatus.APPLIED, 1)
    stepper.step()
    assert restarted.stats.restored == 1
    assert decisions(log) == [(tx, Outcome.COMMIT)]


# ---------------------------------------------------------------- deadlines


def test_the_deadline_rolls_back_a_saga_on_a_tick_with_no_records(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    tx = tx_on(0)
    submit(log, clock, tx, timeout_ms=5_000)
    report(log, clock, tx, StepStatus.APPLIED, 0)
    stepper.step()
    clock.advance(4_999)
    stepper.step()
    assert decisions(log) == []
    clock.advance(1)
    stepper.step()  # nothing read: the tick alone decides
    assert decisions(log) == [(tx, Outcome.ROLLBACK)]
    (decision,) = [decode_as(m.value, Decision) for m in log.records(TOPICS.decisions)]
    assert isinstance(decision, Decision) and "deadline" in decision.reason
    stepper.step(3)
    assert len(decisions(log)) == 1 and service.stats.rollbacks == 1


# ---------------------------------------------------------------- poison records


@contextmanager
def poisoned(log: InMemoryLog, clock: ManualClock) -> Iterator[list[str]]:
    """Write one record of each poison kind; yields where each sits."""
    with log.producer() as producer:
        producer.produce(TOPICS.requests, "junk", b"{not json", partition=0)
        wrong = tx_on(0)
        producer.produce(TOPICS.requests, wrong, encode(request(wrong, clock)), partition=1)
        producer.produce(TOPICS.events, "e", b"[]", partition=1)
        producer.produce(TOPICS.decisions, "d", b"\x00", partition=0)
    yield [
        f"{TOPICS.requests}@0",
        f"{TOPICS.requests}@0",
        f"{TOPICS.events}@0",
        f"{TOPICS.decisions}@0",
    ]


def test_poison_records_go_to_the_dlq_exactly_once_even_through_an_abort(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    stepper.step()
    good = tx_on(1, 1)
    with poisoned(log, clock) as where:
        submit(log, clock, good)
    log.fail_next_commit()
    stepper.step()  # the aborted transaction's dead letters are invisible
    assert dead_letters(log) == []
    stepper.step(3)
    letters = dead_letters(log)
    assert sorted(source for source, _ in letters) == sorted(where)
    assert any("its key belongs on 0" in error for _, error in letters)
    assert service.stats.dlq == 4
    assert state(log, good) is SagaState.PENDING  # the batch's good record went on


def test_every_rejected_record_of_a_batch_is_dead_lettered_once_and_skipped(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    _, stepper = coordinators.start()
    with log.producer() as producer:
        for i in range(3):
            producer.produce(TOPICS.requests, f"bad-{i}", b"x", partition=1)
    stepper.step(3)
    assert sorted(s for s, _ in dead_letters(log)) == [f"{TOPICS.requests}@{i}" for i in range(3)]
    assert log.committed_offset(GROUP, TOPICS.requests, 1) == 3


# ---------------------------------------------------------------- operator resolves


def test_a_resolve_closes_a_failed_compensation_and_a_wrong_one_goes_to_the_dlq(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    tx = tx_on(0)
    submit(log, clock, tx)
    report(log, clock, tx, StepStatus.APPLIED, 0)
    report(log, clock, tx, StepStatus.FAILED, 1)
    stepper.step()
    report(log, clock, tx, StepStatus.COMPENSATION_FAILED, 0)
    report(log, clock, tx, StepStatus.COMPENSATED, 1)
    stepper.step()
    assert state(log, tx) is SagaState.FAILED
    with log.producer() as producer:
        for step in (1, 0):  # step 1 was compensated: nothing to resolve there
            resolve = SagaResolve(tx, step, "refunded by hand", "ann", clock())
            producer.produce(TOPICS.requests, tx, encode(resolve))
    stepper.step()
    found = statuses(log)[tx]
    assert found.state is SagaState.ROLLED_BACK
    assert [s.status for s in found.steps] == [StepStatus.RESOLVED, StepStatus.COMPENSATED]
    assert found.reason is not None and found.reason.endswith("resolved by hand by ann")
    ((where, why),) = dead_letters(log)
    assert where.startswith(TOPICS.requests) and "step 1 has no failed compensation" in why
    assert service.stats.dlq == 1
