"""A client's status view holds what it sent and what it is asked about (issue 31 item 1).

On the in-memory log: statuses of transactions nobody asks about are not even decoded;
a transaction asked about is looked up in the topic once, then followed; what the
client sends is followed from the send on with nothing read, and a resubmission of a
saga finished long ago still gets its outcome (the coordinator publishes a repeated
request's status again); the number followed is bounded, and one dropped is looked up
again when asked about.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from saga.coordinator import SagaClient
from saga.coordinator import _status_view as view_module
from saga.coordinator._service import CoordinatorService
from saga.coordinator._status_view import StatusView
from saga.streams import (
    KafkaSettings,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepProgress,
    StepStatus,
    encode,
)
from saga.streams.kafka import Message
from saga.streams.log import LogConsumer, LogProducer
from saga.streams.testing import InMemoryLog, ManualClock, Stepper

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="v")
TOPICS = SETTINGS.topics


class CountingLog:
    """The in-memory log for a client: counts the look-ups (consumers made to read the
    status topic on demand), and its consumers wait a little when idle."""

    def __init__(self, log: InMemoryLog) -> None:
        self._log = log
        self.lookups = 0

    @property
    def settings(self) -> KafkaSettings:
        return self._log.settings

    def consumer(self, group_id: str | None = None, **options: Any) -> LogConsumer:
        if options.get("client_id") == "saga.client.lookup":
            self.lookups += 1
        return cast(LogConsumer, _Idle(self._log.consumer(group_id, **options)))

    def producer(self, *, client_id: str = "saga") -> LogProducer:
        return self._log.producer(client_id=client_id)


class _Idle:
    def __init__(self, inner: LogConsumer) -> None:
        self._inner = inner

    def poll_batch(self, max_messages: int = 500, timeout: float = 1.0) -> list[Message]:
        got = self._inner.poll_batch(max_messages, timeout)
        if not got:
            time.sleep(min(timeout, 0.01))
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    made = InMemoryLog(SETTINGS, clock=clock)
    made.create_topics(2)
    return made


@pytest.fixture
def client_log(log: InMemoryLog) -> CountingLog:
    return CountingLog(log)


@pytest.fixture
def view(client_log: CountingLog) -> Iterator[StatusView]:
    made = StatusView(SETTINGS, log=client_log)
    yield made
    made.close()


def status(tx: str, state: SagaState = SagaState.COMMITTED) -> SagaStatus:
    done = StepStatus.COMMITTED if state is SagaState.COMMITTED else StepStatus.PENDING
    return SagaStatus(tx, "t", state, (StepProgress("bank", done),), "r", 1, 2, 3, "f" * 32)


def publish(log: InMemoryLog, *records: SagaStatus) -> None:
    with log.producer() as producer:
        for record in records:
            producer.produce(TOPICS.status, record.tx_id, encode(record))


def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.01)


def test_statuses_nobody_asks_about_are_not_held(log: InMemoryLog, view: StatusView) -> None:
    publish(log, *(status(f"other-{i}") for i in range(3000)))
    eventually(lambda: sum(view._done.values()) == 3000)
    assert len(view._known) == 0 and len(view._statuses) == 0


def test_a_transaction_asked_about_is_looked_up_once_then_followed(
    log: InMemoryLog, client_log: CountingLog, view: StatusView
) -> None:
    publish(log, status("old", SagaState.PENDING), *(status(f"o-{i}") for i in range(50)))
    found = view.get("old")
    assert found is not None and found.state is SagaState.PENDING
    assert client_log.lookups == 1
    publish(log, status("old"))  # followed now: the reader takes it
    eventually(lambda: (view.get("old") or status("x", SagaState.PENDING)).state.final)
    assert view.wait_final("old", 1) == status("old")
    assert view.get("never") is None
    assert client_log.lookups == 2  # "old" was not read again; "never" was looked up once
    assert view.get("never") is None and client_log.lookups == 2


def test_history_before_the_view_is_not_read_unless_from_the_beginning(
    log: InMemoryLog, client_log: CountingLog
) -> None:
    publish(log, status("old"))
    late = StatusView(SETTINGS, log=client_log, from_beginning=False)
    try:
        assert late.get("old") is None
        publish(log, status("old", SagaState.PENDING))
        eventually(lambda: late.get("old") is not None)
    finally:
        late.close()


def test_the_number_followed_is_bounded_and_one_dropped_is_looked_up_again(
    log: InMemoryLog, client_log: CountingLog, view: StatusView, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(view_module, "FOLLOWED_KEPT", 5)
    monkeypatch.setattr(view_module, "STATUSES_KEPT", 2)
    for i in range(10):
        view.follow(f"sent-{i}")
    publish(log, *(status(f"sent-{i}") for i in range(10)))
    eventually(lambda: sum(view._done.values()) == 10)
    assert list(view._known) == [f"sent-{i}" for i in range(5, 10)]
    assert list(view._statuses) == ["sent-8", "sent-9"]
    assert view.get("sent-9") == status("sent-9") and client_log.lookups == 0
    assert view.get("sent-5") == status("sent-5")  # its one record, read again by offset
    assert view.get("sent-0") == status("sent-0")  # dropped: looked up in its partition
    assert client_log.lookups == 2 and len(view._known) == 5


def test_a_snapshot_reads_every_transaction(log: InMemoryLog, view: StatusView) -> None:
    publish(log, *(status(f"s-{i}") for i in range(20)))
    with log.producer() as producer:
        producer.produce(TOPICS.status, "s-3", None)  # forgotten
    assert set(view.snapshot()) == {f"s-{i}" for i in range(20)} - {"s-3"}
    assert len(view._known) == 0


def test_a_resubmission_of_a_long_finished_saga_gets_its_outcome(
    log: InMemoryLog, clock: ManualClock, client_log: CountingLog
) -> None:
    """A new client, the same tx_id and steps: nothing is read, the coordinator's repeat
    of the status answers (a retry after a restart, with the tx_id it kept)."""
    service = CoordinatorService(SETTINGS, instance_id="a", clock=clock, log=log)
    stepper = Stepper(log, service.run, stop=service.stop).start()
    try:
        step = Step("bank", "increment", {"target": "t", "key": "k", "field": "n", "by": 1})
        with SagaClient(SETTINGS, log=client_log) as first:
            tx = first.submit([step], saga="pay", timeout=60)
            stepper.step()
            with log.producer() as producer:
                event = StepEvent(tx, 0, "bank", StepStatus.APPLIED, clock())
                producer.produce(TOPICS.events, tx, encode(event))
            stepper.step()
            assert first.result(tx, timeout=5).state is SagaState.COMMITTED
        with SagaClient(SETTINGS, log=client_log) as again:
            again.submit([step], saga="pay", timeout=60, tx_id=tx)
            stepper.step()
            assert again.result(tx, timeout=5).state is SagaState.COMMITTED
        assert client_log.lookups == 0
    finally:
        stepper.stop()


def test_a_record_that_does_not_decode_is_passed_over_when_asked_about(
    log: InMemoryLog, client_log: CountingLog, view: StatusView
) -> None:
    """Kept as read, it is decoded when asked about: junk (anyone may write without keys)
    sends the view back to the topic, where the latest record that stands is found."""
    view.follow("j")
    publish(log, status("j"))
    with log.producer() as producer:
        producer.produce(TOPICS.status, "j", b"not json")
    eventually(lambda: sum(view._done.values()) == 2)
    assert view.get("j") == status("j") and client_log.lookups == 1
    assert view.follow("j") == status("j")  # held again, and still followed
