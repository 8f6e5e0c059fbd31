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

from coordinator._service import CoordinatorService, _Partition
from streams import Mode, SagaRequest, SagaStatus, Step, decode_as, encode
from streams._kafka import (
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


def _request(tx: str) -> SagaRequest:
    now = int(time.time() * 1000)
    return SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=Mode.PARALLEL,
        steps=(Step("ledger", "increment", {"key": "a", "by": 1}),),
        deadline_ms=now + 60_000,
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
        service._partitions = {0: _Partition()}  # partition 1 was revoked during the poll
        service._process(batch, int(time.time() * 1000))
        assert set(service._partitions[0].sagas) == {owned_tx}
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
