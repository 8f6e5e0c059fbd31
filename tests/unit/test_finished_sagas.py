"""Finished sagas live on disk, not in memory (issue 31 item 1), with every guarantee kept.

A saga that ended ``committed`` or ``rolled_back`` leaves the coordinator's heap for its
partition's table on disk (:mod:`coordinator._finished`) until its retention ends. What
must still hold, on the in-memory log: a repeated request of it changes nothing, a
conflicting one goes to the DLQ, late events, aborts and resolves are ignored, it is
forgotten (tombstone, row gone) after the retention, a restart puts it back on disk and
still recognises its repeats, a restore reads through batches the way a reader looking
newest first would, and timer entries of finished sagas do not pile up.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from saga.coordinator._finished import FinishedStore, pack, unpack
from saga.coordinator._machine import Saga
from saga.coordinator._restore import restore
from saga.coordinator._retention import PartitionState, Sagas
from saga.streams import (
    Mode,
    SagaAbort,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepProgress,
    StepStatus,
    encode,
)
from saga.streams.testing import InMemoryLog, ManualClock
from tests._helpers import memory_log
from tests.unit import test_coordinator_service_unit as svc
from tests.unit.test_coordinator_service_unit import (
    SETTINGS,
    TOPICS,
    Running,
    dead_letters,
    decisions,
    report,
    request,
    send,
    state,
    statuses,
    submit,
    tx_on,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, svc.PARTITIONS)


@pytest.fixture
def coordinators(log: InMemoryLog, clock: ManualClock) -> Iterator[Running]:
    running = Running(log, clock)
    yield running
    for stepper in running.steppers:
        if stepper.running:
            stepper.stop()


def status_records(log: InMemoryLog, tx: str) -> int:
    return len([m for m in log.records(TOPICS.status) if m.key == tx.encode()])


def other_steps(tx: str, clock: ManualClock) -> SagaRequest:
    first = request(tx, clock)
    return SagaRequest(
        tx,
        first.saga,
        Mode.PARALLEL,
        (Step("bank", "increment", {"target": "t", "key": "k", "field": "n", "by": 7}),),
        first.deadline_ms,
        first.created_ms,
    )


def test_a_finished_saga_is_on_disk_and_what_comes_for_it_later_changes_nothing(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start()
    tx = tx_on(0)
    sent = request(tx, clock)
    send(log, TOPICS.requests, sent)
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper.step()
    assert state(log, tx) is SagaState.COMMITTED
    assert (service.sagas_in_memory, service.sagas_held) == (0, 1)
    written = status_records(log, tx)

    final = statuses(log)[tx]
    send(log, TOPICS.requests, sent)  # the same request again: recognised, re-announced
    report(log, clock, tx, StepStatus.COMMITTED, 0, 1)  # late events: nothing
    stepper.step()
    assert status_records(log, tx) == written + 1 and statuses(log)[tx] == final
    assert dead_letters(log) == [] and decisions(log) == [(tx, svc.Outcome.COMMIT)]

    send(log, TOPICS.requests, other_steps(tx, clock))  # another payload under its id
    send(log, TOPICS.requests, SagaAbort(tx, "too late", clock()))
    stepper.step()
    errors = [error for _, error in dead_letters(log)]
    assert len(errors) == 2
    assert "already submitted with a different payload" in errors[0]
    assert "already decided" in errors[1]
    assert state(log, tx) is SagaState.COMMITTED and status_records(log, tx) == written + 1
    assert (service.sagas_in_memory, service.sagas_held) == (0, 1)


def test_a_finished_saga_leaves_the_disk_after_the_retention(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    service, stepper = coordinators.start(retention_ms=100_000)
    done, failed = tx_on(0), tx_on(1)
    submit(log, clock, done, failed, timeout_ms=1_000)
    report(log, clock, done, StepStatus.APPLIED, 0, 1)
    report(log, clock, failed, StepStatus.FAILED, 0)
    report(log, clock, failed, StepStatus.COMPENSATED, 1)
    stepper.step()
    report(log, clock, failed, StepStatus.COMPENSATED, 0)
    stepper.step()
    assert state(log, failed) is SagaState.ROLLED_BACK
    assert (service.sagas_in_memory, service.sagas_held) == (0, 2)
    clock.advance(100_999)
    stepper.step()
    assert service.stats.forgotten == 0  # due 100 s after the deadline
    clock.advance(1)
    stepper.step()
    assert service.stats.forgotten == 2 and service.sagas_held == 0
    assert statuses(log) == {}  # tombstones
    send(log, TOPICS.requests, request(done, clock, timeout_ms=1_000))  # a new saga, same id
    stepper.step()
    assert state(log, done) is SagaState.PENDING


def test_a_restart_puts_finished_sagas_back_on_disk_and_still_knows_their_repeats(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    _, stepper = coordinators.start()
    done, rolled, open_ = tx_on(0), tx_on(1), tx_on(0, 1)
    sent = request(done, clock)
    send(log, TOPICS.requests, sent)
    submit(log, clock, rolled, open_)
    report(log, clock, done, StepStatus.APPLIED, 0, 1)
    report(log, clock, rolled, StepStatus.FAILED, 0, 1)
    report(log, clock, open_, StepStatus.APPLIED, 0)
    stepper.step()
    report(log, clock, rolled, StepStatus.COMPENSATED, 0, 1)
    stepper.step()
    stepper.stop()

    restarted, stepper = coordinators.start()
    stepper.step()
    assert restarted.stats.restored == 3
    assert (restarted.sagas_in_memory, restarted.sagas_held) == (1, 3)  # the open one
    part = restarted._partitions[1]
    assert part.sagas[rolled].state is SagaState.ROLLED_BACK
    assert part.sagas.finished.counts == {"rolled_back": 1}
    send(log, TOPICS.requests, sent, other_steps(rolled, clock))
    stepper.step()
    assert [error for _, error in dead_letters(log)] == [
        f"transaction {rolled} was already submitted with a different payload; "
        "the new request is ignored"
    ]
    report(log, clock, open_, StepStatus.APPLIED, 1)
    stepper.step()
    assert state(log, open_) is SagaState.COMMITTED
    assert (restarted.sagas_in_memory, restarted.sagas_held) == (0, 3)


def test_timer_entries_of_finished_sagas_do_not_pile_up(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """Sagas with an hour's deadline that finish at once leave their deadline entries."""
    service, stepper = coordinators.start()
    txs = [tx_on(p, n) for p in range(svc.PARTITIONS) for n in range(1500)]
    for i in range(0, len(txs), 500):
        submit(log, clock, *txs[i : i + 500], timeout_ms=3_600_000)
        for tx in txs[i : i + 500]:
            report(log, clock, tx, StepStatus.APPLIED, 0, 1)
        stepper.step(3)
    assert service.stats.commits == len(txs) and service.sagas_in_memory == 0
    for part in service._partitions.values():
        assert len(part.deadlines) <= 1000 + 500  # pruned at the merge past the slack


# ---------------------------------------------------------------- the rows and the restore


def final_status(tx: str, state: SagaState, steps: tuple[StepProgress, ...]) -> SagaStatus:
    return SagaStatus(tx, "transfer", state, steps, "why", 1, 2, 3, "f" * 64)


@pytest.mark.parametrize(
    "status",
    [
        final_status(
            "a",
            SagaState.COMMITTED,
            (StepProgress("bank", StepStatus.COMMITTED), StepProgress("shop", StepStatus.APPLIED)),
        ),
        final_status(
            "b",
            SagaState.ROLLED_BACK,
            (
                StepProgress("bank", StepStatus.RESOLVED),
                StepProgress("shop", StepStatus.COMPENSATED),
            ),
        ),
        final_status("c", SagaState.COMMITTED, (StepProgress("x", StepStatus.APPLIED, True),)),
    ],
)
def test_a_row_on_disk_is_the_saga_a_restore_rebuilds(status: SagaStatus) -> None:
    saga = Saga.from_status(status)
    assert unpack(saga.tx_id, saga.state.value, pack(saga)) == saga
    table = FinishedStore().table(3)
    table.put(saga, 10)
    assert table.get(saga.tx_id) == saga and saga.tx_id in table and len(table) == 1
    assert table.due(9, 10) == [] and table.due(10, 10) == [(10, saga.tx_id)]
    table.remove(saga.tx_id)
    assert table.get(saga.tx_id) is None and len(table) == 0 and table.next_due() is None


def test_a_restore_keeps_the_newest_record_that_stands_across_batches(
    log: InMemoryLog, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("saga.coordinator._restore._BATCH", 2)  # a transaction over batches
    steps = (StepProgress("bank", StepStatus.COMMITTED),)
    pending = SagaStatus(
        "p", "t", SagaState.PENDING, (StepProgress("bank", StepStatus.PENDING),), None, 1, 1, 9, "f"
    )
    records: list[tuple[str, bytes | None]] = [
        ("done", encode(final_status("done", SagaState.COMMITTED, steps))),
        ("back", encode(final_status("back", SagaState.COMMITTED, steps))),
        ("gone", encode(final_status("gone", SagaState.COMMITTED, steps))),
        ("p", encode(pending)),
        ("back", encode(SagaStatus("back", "t", SagaState.PENDING, steps, None, 1, 1, 9, "f"))),
        ("gone", None),
        ("done", b'{"v": 1, "type": "saga.status", "tx_id": "done", "state": [1]}'),
        ("p", encode(final_status("p", SagaState.ROLLED_BACK, steps))),
        ("done", b"not json"),
    ]
    with log.producer() as producer:
        for key, value in records:
            producer.produce(TOPICS.status, key, value, partition=0)
    part = PartitionState(Sagas(FinishedStore().table(0)))
    forged: list[str] = []
    restore(
        log,
        TOPICS.status,
        {0: part},
        client_id="t",
        keys=None,
        on_forged=lambda m, why: forged.append(why),
        forget_at=lambda saga: saga.updated_ms + 1000 if saga.state.final else None,
    )
    assert set(part.sagas.live) == {"back"}  # a later in-flight record stands over a final one
    assert part.sagas.finished.counts == {"committed": 1, "rolled_back": 1}
    assert part.sagas["done"].state is SagaState.COMMITTED  # the junk on top is passed over
    assert part.sagas["p"].state is SagaState.ROLLED_BACK
    assert "gone" not in part.sagas and forged == []
    assert part.sagas.finished.next_due() == 1002
