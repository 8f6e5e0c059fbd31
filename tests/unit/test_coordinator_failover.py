"""The coordinator rides through what a Kafka broker failover does to its transactions.

Each case of coordinator._txn, on the in-memory log with injected errors: the
coordinator keeps running (no exit, no restart), decides every saga exactly once,
and its state and offsets stay those of the log. A real fence (a newer instance
with the same id, which also takes over the static group membership) still stops it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import saga.coordinator._txn as txn_module
from saga.streams import FatalKafkaError, Outcome, SagaState, StepStatus, TransientError
from saga.streams.kafka import TransactionAborted
from saga.streams.testing import InMemoryConsumer, InMemoryLog, ManualClock
from tests.unit.test_coordinator_service_unit import (
    GROUP,
    PARTITIONS,
    SETTINGS,
    TOPICS,
    Running,
    decisions,
    report,
    state,
    submit,
    tx_on,
)

pytestmark = pytest.mark.unit

TXN_ID = f"{TOPICS.prefix}.coordinator.a"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    made = InMemoryLog(SETTINGS, clock=clock)
    made.create_topics(PARTITIONS)
    return made


@pytest.fixture
def coordinators(
    log: InMemoryLog, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Running]:
    # One paused poll is enough here: the in-memory group fences a replaced member at once.
    monkeypatch.setattr(txn_module, "FENCE_CHECK_S", 0.0)
    monkeypatch.setattr("saga.coordinator._txn.time.sleep", lambda _s: None)
    running = Running(log, clock)
    yield running
    for stepper in running.steppers:
        if stepper.running:
            stepper.stop()


def settle(log: InMemoryLog, clock: ManualClock, tx: str) -> None:
    submit(log, clock, tx)
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)


def caught_up(log: InMemoryLog) -> bool:
    return all(
        log.committed_offset(GROUP, topic, p) in (None, log.end_offset(topic, p))
        for topic in (TOPICS.requests, TOPICS.events)
        for p in range(PARTITIONS)
    )


@pytest.mark.parametrize(
    ("call", "error", "after", "resets"),
    [
        # abortable (incl. librdkafka's KIP-360 epoch bump): abort, rewind, again
        ("commit", TransactionAborted("INVALID_PRODUCER_EPOCH: abortable"), False, 0),
        # AddOffsetsToTxn timed out: never committed, so abort and rewind are enough
        ("send_offsets", TransientError("AddOffsetsToTxn timed out"), False, 0),
        # fatal INVALID_TXN_STATE ending the transaction: a new producer, reloaded state
        ("commit", FatalKafkaError("EndTxn: INVALID_TXN_STATE"), False, 1),
        # the same after the commit went through (its answer lost): decided once anyway
        ("commit", FatalKafkaError("EndTxn: INVALID_TXN_STATE"), True, 1),
        # a commit that timed out: outcome unknown, Kafka tells (both ways)
        ("commit", TransientError("EndTxn timed out"), False, 1),
        ("commit", TransientError("EndTxn timed out"), True, 1),
        # the broker bumped the epoch (no newer instance): fenced code, not a real fence
        ("commit", FatalKafkaError("fenced", fenced=True), False, 1),
        ("send_offsets", FatalKafkaError("fenced", fenced=True), False, 1),
    ],
)
def test_the_coordinator_rides_through_a_failed_transaction_and_decides_once(
    log: InMemoryLog,
    clock: ManualClock,
    coordinators: Running,
    call: str,
    error: Exception,
    after: bool,
    resets: int,
) -> None:
    service, stepper = coordinators.start("a")
    txs = [tx_on(0), tx_on(1)]
    for tx in txs:
        settle(log, clock, tx)
    log.fail_next_call(TXN_ID, call, error, after=after)  # type: ignore[arg-type]
    stepper.step(4)
    assert stepper.running, "the coordinator exited"
    assert service._txns.resets == resets
    assert sorted(decisions(log)) == sorted((tx, Outcome.COMMIT) for tx in txs)
    assert all(state(log, tx) is SagaState.COMMITTED for tx in txs)
    assert caught_up(log)
    # It goes on deciding with the same state: a new saga commits, nothing is decided twice.
    late = tx_on(1, 1)
    settle(log, clock, late)
    stepper.step(2)
    assert sorted(decisions(log)) == sorted((tx, Outcome.COMMIT) for tx in [*txs, late])


def test_a_producer_fenced_by_a_bare_init_of_its_id_is_replaced_not_stopped(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """An epoch bump with no newer group member (what a transaction coordinator failover
    does) is not a real fence: the coordinator makes a new producer and goes on."""
    service, stepper = coordinators.start("a")
    tx = tx_on(0)
    submit(log, clock, tx)
    log.transactional_producer(TXN_ID).init()  # the broker's epoch bump, modelled
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper.step(3)
    assert stepper.running
    assert service._txns.resets == 1
    assert decisions(log) == [(tx, Outcome.COMMIT)]


def test_a_coordinator_replaced_by_a_newer_instance_still_stops(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """A real fence: a newer instance took the transactional id and the static membership."""
    service, old = coordinators.start("a")
    tx = tx_on(0)
    submit(log, clock, tx)
    log.transactional_producer(TXN_ID).init()  # the newer instance's producer...
    newer = log.consumer(GROUP, client_id="newer", group_instance_id=f"{GROUP}.a")
    newer.subscribe([TOPICS.requests, TOPICS.events, TOPICS.decisions])  # ...and member
    with pytest.raises(FatalKafkaError, match="fenced"):
        old.step(3)
    assert service._txns.resets == 0
    assert decisions(log) == []


def test_the_fence_check_stops_a_zombie_whose_producer_call_fails_first(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """The producer learns of the fence before the consumer: the check asks the group."""
    service, old = coordinators.start("a")
    tx = tx_on(0)
    settle(log, clock, tx)
    consumer = service._consumer
    assert isinstance(consumer, InMemoryConsumer)
    # Replaced while its batch runs: the commit is the first call to learn of it.
    log.fail_next_call(TXN_ID, "commit", FatalKafkaError("fenced", fenced=True))
    consumer.replaced = True
    with pytest.raises(FatalKafkaError, match="fenced"):
        old.step(3)
    assert service._txns.resets == 0


def test_a_restore_retries_the_status_topic_end_while_its_leader_moves(
    log: InMemoryLog, clock: ManualClock, coordinators: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, stepper = coordinators.start("a")
    tx = tx_on(0)
    submit(log, clock, tx)
    stepper.step()
    stepper.stop()
    failures = iter([True, True, True])
    real = InMemoryConsumer.watermarks

    def flaky(self: InMemoryConsumer, topic: str, partition: int, timeout: float = 10.0):  # type: ignore[no-untyped-def]
        if topic == TOPICS.status and next(failures, False):
            raise TransientError(f"reading the offsets of {topic} [{partition}]: timed out")
        return real(self, topic, partition, timeout)

    monkeypatch.setattr(InMemoryConsumer, "watermarks", flaky)
    monkeypatch.setattr(
        "saga.coordinator._txn.time.sleep", lambda _s: None
    )  # the retry lives there
    again, stepper = coordinators.start("a")
    stepper.step()
    assert stepper.running
    assert again.stats.restored == 1
    report(log, clock, tx, StepStatus.APPLIED, 0, 1)
    stepper.step()
    assert decisions(log) == [(tx, Outcome.COMMIT)]


# ---------------------------------------------------------------- librdkafka errors


def _kafka_error(code: int, *, fatal: bool = False, abortable: bool = False) -> object:
    import confluent_kafka as ck

    return ck.KafkaError(code, "broker said no", fatal=fatal, txn_requires_abort=abortable)


def test_an_abortable_epoch_error_aborts_the_transaction_instead_of_stopping() -> None:
    """KIP-360: librdkafka bumps the epoch itself and reports an abortable error."""
    import confluent_kafka as ck

    from saga.streams.kafka._translate import _translate

    err = _kafka_error(ck.KafkaError.INVALID_PRODUCER_EPOCH, abortable=True)
    error = _translate(err, "committing", text="x", transactional_id=TXN_ID)  # type: ignore[arg-type]
    assert isinstance(error, TransactionAborted)


@pytest.mark.parametrize(
    ("code", "fenced"),
    [("_FENCED", True), ("PRODUCER_FENCED", True), ("INVALID_TXN_STATE", False)],
)
def test_fatal_transactional_errors_say_whether_the_epoch_was_refused(
    code: str, fenced: bool
) -> None:
    import confluent_kafka as ck

    from saga.streams.kafka._translate import _translate

    err = _kafka_error(getattr(ck.KafkaError, code), fatal=True)
    error = _translate(err, "committing", text="x", transactional_id=TXN_ID)  # type: ignore[arg-type]
    assert isinstance(error, FatalKafkaError)
    assert error.fenced is fenced


def test_a_coordinator_fenced_by_its_own_instance_id_rejoins_and_goes_on(
    log: InMemoryLog, clock: ManualClock, coordinators: Running
) -> None:
    """librdkafka's self-fence (issue #3437): the member's id fenced with no newer process.

    The consumer rejoins in-process (streams._rejoin): the owned partitions are lost and
    restored from the status topic; the producer is left alone (no newer one exists)."""
    service, stepper = coordinators.start("a")
    early = tx_on(0)
    settle(log, clock, early)
    stepper.step(2)
    assert decisions(log) == [(early, Outcome.COMMIT)]
    consumer = service._consumer
    assert isinstance(consumer, InMemoryConsumer)
    log._leave(consumer)  # dropped by the group, as the broker drops a fenced member
    consumer.replaced = True
    late = tx_on(1)
    settle(log, clock, late)
    stepper.step(4)
    assert stepper.running, "the coordinator exited"
    assert consumer.rejoins == 1
    assert service._txns.resets == 0
    assert sorted(decisions(log)) == sorted([(early, Outcome.COMMIT), (late, Outcome.COMMIT)])
    assert caught_up(log)
