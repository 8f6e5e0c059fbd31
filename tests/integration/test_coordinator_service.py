"""The coordinator service's batch handling against the real broker.

A rebalance runs inside the poll that returns a batch, so a batch can hold
records of a partition this instance has just lost. Those records belong to the
partition's new owner: the batch must neither process them nor commit their
offsets (committed, they would be skipped by the new owner).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from saga.coordinator._retention import PartitionState
from saga.coordinator._service import CoordinatorService
from saga.streams import (
    Mode,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepStatus,
    decode_as,
    encode,
)
from saga.streams.kafka import (
    Consumer,
    KafkaSettings,
    Message,
    Producer,
    create_topics,
    delete_topics,
    partition_for,
)
from tests._infra import Services

pytestmark = pytest.mark.integration

PARTITIONS = 2


@pytest.fixture
def settings(services: Services, topic_prefix: str) -> Iterator[KafkaSettings]:
    """The saga topics under a fresh prefix, deleted afterwards."""
    made = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=topic_prefix)
    create_topics(made, PARTITIONS)
    yield made
    delete_topics(made, made.topics.all)


def _tx_on(partition: int) -> str:
    for i in range(1000):
        tx = f"tx-{partition}-{i}"
        if partition_for(tx, PARTITIONS) == partition:
            return tx
    raise AssertionError("no key for the partition")


def _request(tx: str, now: int | None = None, timeout_ms: int = 60_000) -> SagaRequest:
    now = int(time.time() * 1000) if now is None else now
    return SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=Mode.PARALLEL,
        steps=(Step("ledger", "increment", {"key": "a", "by": 1}),),
        deadline_ms=now + timeout_ms,
        created_ms=now,
    )


def _read_all(settings: KafkaSettings, topic: str, expected: int) -> list[Message]:
    reader = Consumer(settings, group_id=None, client_id="cs-test.reader")
    try:
        reader.assign([(topic, p, 0) for p in range(PARTITIONS)])
        found: list[Message] = []
        deadline = time.monotonic() + 30
        while len(found) < expected and time.monotonic() < deadline:
            found += reader.poll_batch(100, 0.5)
        return found
    finally:
        reader.close()


def test_records_of_a_lost_partition_are_neither_processed_nor_committed(
    settings: KafkaSettings,
) -> None:
    owned_tx, lost_tx = _tx_on(0), _tx_on(1)
    producer = Producer(settings)
    for tx in (owned_tx, lost_tx):
        producer.produce(settings.topics.requests, tx, encode(_request(tx)))
    producer.flush(10)
    producer.close()
    batch = _read_all(settings, settings.topics.requests, 2)
    assert sorted(m.partition for m in batch) == [0, 1]

    service = CoordinatorService(settings, instance_id=f"t{uuid.uuid4().hex[:6]}")
    try:
        service._producer.init()
        service._partitions = {0: PartitionState()}  # partition 1 was revoked during the poll
        service._partition_count = PARTITIONS
        service._process(batch, int(time.time() * 1000))
        assert set(service._partitions[0].sagas.live) == {owned_tx}
    finally:
        service._consumer.close()
        service._producer.close()

    group = Consumer(settings, group_id=f"{settings.topics.prefix}.coordinator", client_id="cs")
    try:
        committed = group.committed([(settings.topics.requests, p) for p in range(PARTITIONS)])
    finally:
        group.close()
    assert committed == {(settings.topics.requests, 0): 1, (settings.topics.requests, 1): None}
    statuses = [
        decode_as(m.value, SagaStatus) for m in _read_all(settings, settings.topics.status, 1)
    ]
    assert [s.tx_id for s in statuses] == [owned_tx]


# ---------------------------------------------------------------- retention


class _Driven:
    """A coordinator whose batches the test feeds, at the times the test chooses."""

    def __init__(self, settings: KafkaSettings, retention_ms: int) -> None:
        self.settings = settings
        self.service = CoordinatorService(
            settings, instance_id=f"t{uuid.uuid4().hex[:6]}", retention_ms=retention_ms
        )
        self.service._producer.init()
        self.service._partition_count = PARTITIONS
        self.service._partitions = {p: PartitionState() for p in range(PARTITIONS)}
        self.reader = Consumer(settings, group_id=None, client_id="cs-test.driven")
        topics = settings.topics
        self.reader.assign(
            [(t, p, 0) for t in (topics.requests, topics.events) for p in range(PARTITIONS)]
        )
        self.producer = Producer(settings)

    def send(self, topic: str, key: str, value: bytes) -> None:
        self.producer.produce(topic, key, value)
        self.producer.flush(10)

    def step(self, now: int, expected: int) -> None:
        """Read ``expected`` records (or none) and process them as one batch at ``now``."""
        batch: list[Message] = []
        deadline = time.monotonic() + 30
        while len(batch) < expected and time.monotonic() < deadline:
            batch += self.reader.poll_batch(100, 0.2)
        assert len(batch) == expected
        self.service._process(batch, now)

    def close(self) -> None:
        self.reader.close()
        self.producer.close()
        self.service._consumer.close()
        self.service._producer.close()


def test_a_finished_saga_is_forgotten_after_the_retention_and_stays_forgotten(
    settings: KafkaSettings,
) -> None:
    topics = settings.topics
    tx, stray = _tx_on(0), _tx_on(1)
    t0 = int(time.time() * 1000)
    driven = _Driven(settings, retention_ms=10_000)
    try:
        request = _request(tx, now=t0, timeout_ms=5_000)
        driven.send(topics.requests, tx, encode(request))
        driven.send(topics.events, tx, encode(StepEvent(tx, 0, "ledger", StepStatus.APPLIED, t0)))
        driven.send(topics.events, tx, encode(StepEvent(tx, 0, "ledger", StepStatus.COMMITTED, t0)))
        # An event whose request never comes: a placeholder.
        driven.send(topics.events, stray, encode(StepEvent(stray, 0, "x", StepStatus.APPLIED, t0)))
        driven.step(t0 + 100, expected=4)
        service = driven.service
        assert service._partitions[0].sagas[tx].state is SagaState.COMMITTED
        assert stray in service._partitions[1].sagas
        assert service.sagas_held == 2

        # Not yet: 10 s after the last change, and after the deadline (t0 + 5 s).
        driven.step(t0 + 10_099, expected=0)
        assert service.sagas_held == 2
        driven.step(t0 + 10_100, expected=0)  # the placeholder: 10 s after its last change
        assert service.sagas_held == 1 and stray not in service._partitions[1].sagas
        driven.step(t0 + 15_000, expected=0)  # the saga: 10 s after its deadline
        assert service.sagas_held == 0
        assert service.stats.forgotten == 2

        # The status topic holds a tombstone last, for both; a restart restores nothing.
        last: dict[str, bytes | None] = {}
        for m in _read_all(settings, topics.status, 4):
            last[(m.key or b"").decode()] = m.value
        assert last == {tx: None, stray: None}
        fresh = CoordinatorService(settings, instance_id=f"t{uuid.uuid4().hex[:6]}")
        try:
            assert {p: len(s.sagas) for p, s in fresh._restore([0, 1]).items()} == {0: 0, 1: 0}
        finally:
            fresh._consumer.close()
            fresh._producer.close()

        # The same request again, now past its deadline by more than the retention: it may
        # be a forgotten saga's, so it is rejected as expired, never decided.
        driven.send(topics.requests, tx, encode(request))
        driven.step(t0 + 15_001, expected=1)
        assert service.sagas_held == 0 and service.stats.expired_requests == 1
        (letter,) = _read_all(settings, topics.dlq, 1)
        assert (letter.header("saga.error") or b"").startswith(b"request expired")
    finally:
        driven.close()


def test_a_kept_saga_is_published_again_every_half_retention(settings: KafkaSettings) -> None:
    """The status topic deletes records older than twice the retention: what the
    coordinator keeps (here a saga pending with a long deadline) must be republished."""
    topics = settings.topics
    tx = _tx_on(0)
    t0 = int(time.time() * 1000)
    driven = _Driven(settings, retention_ms=10_000)
    try:
        driven.send(topics.requests, tx, encode(_request(tx, now=t0, timeout_ms=600_000)))
        driven.step(t0 + 100, expected=1)
        service = driven.service
        assert service.stats.refreshed == 0
        driven.step(t0 + 5_099, expected=0)  # not half a retention since it was published
        assert service.stats.refreshed == 0
        service._next_refresh_ms = 0  # the next sweep is due
        driven.step(t0 + 5_100, expected=0)
        assert service.stats.refreshed == 1
        driven.step(t0 + 7_700, expected=0)  # the sweep after, a quarter retention later
        assert service.stats.refreshed == 1  # published 2.6 s ago: not yet again
        statuses = [m for m in _read_all(settings, topics.status, 2) if m.key == tx.encode()]
        assert len(statuses) == 2 and statuses[0].value == statuses[1].value
        assert service._partitions[0].sagas[tx].state is SagaState.PENDING
    finally:
        driven.close()
