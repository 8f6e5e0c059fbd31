"""The Kafka wrappers against the real broker (SAGA_KAFKA_BOOTSTRAP, default 127.0.0.1:19092).

Each test uses its own topic prefix and deletes its topics afterwards.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from saga.streams._errors import ConfigurationError, FatalKafkaError, SagaError
from saga.streams.kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaSettings,
    Message,
    Partition,
    Producer,
    TransactionAborted,
    TransactionalProducer,
    create_topics,
    delete_topics,
    describe_partitions,
    partition_for,
    send_to_dlq,
    topic_config,
    wait_for_broker,
)

pytestmark = pytest.mark.integration

BOOTSTRAP = os.environ.get("SAGA_KAFKA_BOOTSTRAP", "127.0.0.1:19092")
PARTITIONS = 3


@pytest.fixture
def settings() -> Iterator[KafkaSettings]:
    """Settings with a fresh topic prefix; every topic under it is deleted afterwards."""
    made = KafkaSettings(bootstrap=BOOTSTRAP, prefix=f"kw-{uuid.uuid4().hex[:12]}")
    wait_for_broker(made, timeout=15)
    yield made
    delete_topics(made, made.topics.all)


@pytest.fixture
def ready(settings: KafkaSettings) -> KafkaSettings:
    """``settings`` with its five topics created."""
    create_topics(settings, PARTITIONS)
    return settings


@pytest.fixture
def closing() -> Iterator[Callable[[Consumer | Producer | TransactionalProducer], None]]:
    """Registers clients to close at the end of the test, whatever happens."""
    clients: list[Consumer | Producer | TransactionalProducer] = []
    yield clients.append
    for client in reversed(clients):
        client.close()


def read_until(
    consumer: Consumer,
    done: Callable[[list[Message]], bool],
    timeout: float = 20.0,
) -> list[Message]:
    """Poll until ``done(records so far)`` or the deadline; returns what was read."""
    records: list[Message] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records.extend(consumer.poll_batch(100, 0.2))
        if done(records):
            return records
    return records


def read_topic(
    settings: KafkaSettings, topic: str, *, committed_only: bool = True
) -> list[Message]:
    """Everything readable on ``topic`` now (up to each partition's high watermark)."""
    reader = Consumer(
        settings,
        isolation_level="read_committed" if committed_only else "read_uncommitted",
    )
    try:
        count = reader.list_partitions(topic)
        reader.assign({(topic, p): OFFSET_BEGINNING for p in range(count)})
        ends = {p: reader.watermarks(topic, p)[1] for p in range(count)}

        def caught_up(_: list[Message]) -> bool:
            positions = reader.position([(topic, p) for p in range(count)])
            return all((positions[(topic, p)] or 0) >= ends[p] for p in range(count))

        if not any(ends.values()):
            return []
        return read_until(reader, caught_up)
    finally:
        reader.close()


# --------------------------------------------------------------------------- topics


def test_create_topics_makes_six_topics_and_compacts_status_and_registry(
    settings: KafkaSettings,
) -> None:
    topics = settings.topics
    created = create_topics(settings, PARTITIONS)
    assert created == list(topics.all)
    for name in topics.all:
        assert describe_partitions(settings, name) == PARTITIONS
    status = topic_config(settings, topics.status)
    assert status["cleanup.policy"] == "compact,delete"
    # twice the default retention (7 days): what the coordinator keeps is republished
    # every half retention, so it is never deleted
    assert status["retention.ms"] == str(14 * 86_400_000)
    assert topic_config(settings, topics.participants)["cleanup.policy"] == "compact,delete"
    assert topic_config(settings, topics.events)["cleanup.policy"] == "delete"


def test_the_status_topic_follows_the_retention_it_is_created_with(
    settings: KafkaSettings,
) -> None:
    create_topics(settings, PARTITIONS, retention_ms=60_000, status_segment_bytes=1 << 20)
    status = topic_config(settings, settings.topics.status)
    assert (status["retention.ms"], status["segment.ms"], status["segment.bytes"]) == (
        "120000",
        "60000",
        str(1 << 20),
    )


def test_create_topics_again_is_a_no_op(settings: KafkaSettings) -> None:
    create_topics(settings, PARTITIONS)
    assert create_topics(settings, PARTITIONS) == []


def test_other_partition_count_is_refused_with_a_sentence(ready: KafkaSettings) -> None:
    with pytest.raises(ConfigurationError) as caught:
        create_topics(ready, PARTITIONS + 1)
    message = str(caught.value)
    assert f"already exists with {PARTITIONS} partition(s), not {PARTITIONS + 1}" in message
    assert f"--partitions {PARTITIONS}" in message


def test_missing_topic_is_a_configuration_error(settings: KafkaSettings) -> None:
    with pytest.raises(ConfigurationError, match="does not exist: create the topics"):
        describe_partitions(settings, settings.topics.requests)


def test_subscribing_to_a_missing_topic_fails_with_a_hint(
    settings: KafkaSettings, closing: Callable[[Consumer], None]
) -> None:
    consumer = Consumer(settings, f"{settings.prefix}.g")
    closing(consumer)
    consumer.subscribe([settings.topics.requests])
    with pytest.raises(ConfigurationError, match="does not exist: create the topics"):
        read_until(consumer, lambda _: False, timeout=15)


# --------------------------------------------------------------------------- producing and reading


def test_delivery_reports_offsets_and_consumer_positions(
    ready: KafkaSettings, closing: Callable[[Consumer | Producer], None]
) -> None:
    topic = ready.topics.requests
    producer = Producer(ready)
    closing(producer)
    delivered: list[tuple[SagaError | None, Message]] = []
    for i in range(5):
        producer.produce(
            topic, "tx-1", f"r{i}".encode(), on_delivery=lambda e, m: delivered.append((e, m))
        )
    producer.flush(10)
    assert [e for e, _ in delivered] == [None] * 5
    partitions = {m.partition for _, m in delivered}
    assert len(partitions) == 1  # one key, one partition
    (part,) = partitions
    assert [m.offset for _, m in delivered] == [0, 1, 2, 3, 4]

    reader = Consumer(ready)
    closing(reader)
    assert reader.list_partitions(topic) == PARTITIONS
    assert reader.watermarks(topic, part) == (0, 5)
    reader.assign({(topic, part): 2})  # the next offset to read
    got = read_until(reader, lambda rs: len(rs) >= 3)
    assert [(m.offset, m.key, m.value) for m in got] == [
        (2, b"tx-1", b"r2"),
        (3, b"tx-1", b"r3"),
        (4, b"tx-1", b"r4"),
    ]
    assert reader.position([(topic, part)]) == {(topic, part): 5}
    assert reader.assignment() == [(topic, part)]

    reader.seek(topic, part, 0)
    again = read_until(reader, lambda rs: len(rs) >= 5)
    assert [m.offset for m in again] == [0, 1, 2, 3, 4]

    reader.pause([(topic, part)])
    producer.produce(topic, "tx-1", b"r5")
    producer.flush(10)
    assert reader.poll_batch(10, 1.0) == []
    reader.resume([(topic, part)])
    assert [m.value for m in read_until(reader, lambda rs: len(rs) >= 1)] == [b"r5"]

    assert reader.pause_all() == [(topic, part)]
    producer.produce(topic, "tx-1", b"r6")
    producer.flush(10)
    assert reader.poll_batch(10, 1.0) == []
    reader.resume_all()
    assert [m.value for m in read_until(reader, lambda rs: len(rs) >= 1)] == [b"r6"]

    reader.assign([(topic, part, 6)])  # the (topic, partition, offset) form
    assert [m.value for m in read_until(reader, lambda rs: len(rs) >= 1)] == [b"r6"]


def test_keys_land_where_the_java_partitioner_puts_them(
    ready: KafkaSettings, closing: Callable[[Producer], None]
) -> None:
    producer = Producer(ready)
    closing(producer)
    landed: dict[bytes, int] = {}

    def note(error: SagaError | None, message: Message) -> None:
        assert error is None and message.key is not None
        landed[message.key] = message.partition

    keys = [f"tx-{i}" for i in range(20)]
    for key in keys:
        producer.produce(ready.topics.requests, key, b"{}", on_delivery=note)
    producer.flush(10)
    assert landed == {key.encode(): partition_for(key, PARTITIONS) for key in keys}
    assert len(set(landed.values())) == PARTITIONS


def test_plain_producer_flush_counts_deliveries(
    ready: KafkaSettings, closing: Callable[[Producer], None]
) -> None:
    producer = Producer(ready, compression="none")
    closing(producer)
    for i in range(4):
        producer.produce(ready.topics.events, f"tx-{i}", b"{}")
    assert producer.flush(10) == 4
    assert producer.flush(10) == 0


def test_commits_without_waiting_leave_one_at_a_time_and_end_at_the_last_offsets(
    ready: KafkaSettings, closing: Callable[[Consumer | Producer | TransactionalProducer], None]
) -> None:
    """The group coordinator answers one commit of a connection at a time, ~5 ms each:
    thousands sent without waiting queued ahead of the heartbeats until the broker
    dropped the member (a participant stalled 12 s in the bench's open loop)."""
    group = f"{ready.prefix}.g"
    assigned: list[Partition] = []
    consumer = Consumer(ready, group, group_instance_id="w0", on_assign=assigned.extend)
    closing(consumer)
    consumer.subscribe([ready.topics.requests])
    read_until(consumer, lambda _: len(assigned) == PARTITIONS)
    assert len(assigned) == PARTITIONS
    calls = 3000
    for n in range(1, calls + 1):  # a batch's commit after each of 3,000 tiny batches
        consumer.commit_async({tp: n for tp in assigned})
        consumer.poll_batch(10, 0)
    assert consumer.commits_sent < calls // 2  # held back while one was in flight
    # Another client of the group reads its committed offsets over its own connection.
    reader = Consumer(ready, group)
    closing(reader)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        consumer.poll_batch(10, 0.05)  # reads the answers, sends what is held
        if set(reader.committed(assigned).values()) == {calls}:
            break
    assert reader.committed(assigned) == dict.fromkeys(assigned, calls)
    assert consumer.commit_failures == 0
    assert consumer.rejoins == 0


# --------------------------------------------------------------------------- transactions


def test_committed_transaction_carries_records_and_group_offsets(
    ready: KafkaSettings,
    closing: Callable[[Consumer | Producer | TransactionalProducer], None],
) -> None:
    topics = ready.topics
    source = Producer(ready)
    closing(source)
    for i in range(6):
        source.produce(topics.requests, f"tx-{i}", f"request {i}".encode())
    source.flush(10)

    assigned: list[Partition] = []
    group = f"{ready.prefix}.coordinator"
    consumer = Consumer(ready, group, on_assign=assigned.extend)
    closing(consumer)
    consumer.subscribe([topics.requests])
    inputs = read_until(consumer, lambda rs: len(rs) >= 6)
    assert len(inputs) == 6
    assert sorted(assigned) == [(topics.requests, p) for p in range(PARTITIONS)]

    producer = TransactionalProducer(ready, f"{ready.prefix}.coordinator-0")
    closing(producer)
    producer.init()
    producer.begin()
    for message in inputs:
        assert message.key is not None
        producer.produce(topics.events, message.key, b"seen " + (message.value or b""))
    offsets: dict[Partition, int] = {}
    for message in inputs:
        offsets[message.partition_key] = message.next_offset
    producer.send_offsets(consumer, offsets)
    producer.commit()

    outputs = read_topic(ready, topics.events)
    assert sorted(m.value or b"" for m in outputs) == sorted(
        b"seen request " + str(i).encode() for i in range(6)
    )
    committed = consumer.committed(list(offsets))
    assert committed == offsets
    # Offsets are "next to read": they equal each partition's end after reading everything.
    for (topic, part), offset in offsets.items():
        assert consumer.watermarks(topic, part)[1] == offset


def test_aborted_transaction_is_invisible_to_read_committed(
    ready: KafkaSettings, closing: Callable[[TransactionalProducer], None]
) -> None:
    topic = ready.topics.decisions
    producer = TransactionalProducer(ready, f"{ready.prefix}.tx")
    closing(producer)
    producer.init()
    producer.begin()
    producer.produce(topic, "tx-a", b"aborted 1")
    producer.produce(topic, "tx-b", b"aborted 2")
    producer.flush(10)  # on the broker, so the abort has something to hide
    producer.abort()
    producer.begin()
    producer.produce(topic, "tx-c", b"committed")
    producer.commit()

    assert [m.value for m in read_topic(ready, topic)] == [b"committed"]
    everything = read_topic(ready, topic, committed_only=False)
    assert sorted(m.value or b"" for m in everything) == [b"aborted 1", b"aborted 2", b"committed"]


def test_a_newer_instance_fences_an_open_transaction(
    ready: KafkaSettings, closing: Callable[[TransactionalProducer], None]
) -> None:
    topic = ready.topics.status
    transactional_id = f"{ready.prefix}.coordinator-0"
    zombie = TransactionalProducer(ready, transactional_id)
    closing(zombie)
    zombie.init()
    zombie.begin()
    zombie.produce(topic, "tx-1", b"from the zombie")
    zombie.flush(10)

    successor = TransactionalProducer(ready, transactional_id)
    closing(successor)
    successor.init()  # aborts the zombie's open transaction and fences it

    with pytest.raises(FatalKafkaError, match="fenced by a newer instance") as caught:
        zombie.commit()
    assert caught.value.retryable is False
    # Every later call says the same; produce() is refused as well.
    with pytest.raises(FatalKafkaError, match="fenced by a newer instance"):
        zombie.produce(topic, "tx-2", b"again")
    with pytest.raises(FatalKafkaError, match="fenced by a newer instance"):
        zombie.begin()

    successor.begin()
    successor.produce(topic, "tx-1", b"from the successor")
    successor.commit()
    assert [m.value for m in read_topic(ready, topic)] == [b"from the successor"]


def test_a_fenced_idle_producer_fails_on_its_next_transaction(
    ready: KafkaSettings, closing: Callable[[TransactionalProducer], None]
) -> None:
    topic = ready.topics.events
    transactional_id = f"{ready.prefix}.participant-0"
    zombie = TransactionalProducer(ready, transactional_id)
    closing(zombie)
    zombie.init()
    zombie.begin()
    zombie.produce(topic, "tx-1", b"before the takeover")
    zombie.commit()

    successor = TransactionalProducer(ready, transactional_id)
    closing(successor)
    successor.init()

    # begin() is local to the client, so the zombie learns it is fenced only when
    # the broker refuses its records or its commit.
    zombie.begin()
    zombie.produce(topic, "tx-2", b"after the takeover")
    with pytest.raises(FatalKafkaError, match="fenced by a newer instance"):
        zombie.commit()
    assert [m.value for m in read_topic(ready, topic)] == [b"before the takeover"]


def test_a_failed_record_makes_the_transaction_abortable(
    ready: KafkaSettings, closing: Callable[[TransactionalProducer], None]
) -> None:
    # A short message timeout makes the record to a missing topic fail quickly.
    impatient = KafkaSettings(ready.bootstrap, ready.prefix, {"message.timeout.ms": "2000"})
    topic = ready.topics.events
    producer = TransactionalProducer(impatient, f"{ready.prefix}.tx")
    closing(producer)
    producer.init()
    producer.begin()
    producer.produce(topic, "tx-1", b"good")
    producer.produce(f"{ready.prefix}.missing", "tx-1", b"lost")
    with pytest.raises(TransactionAborted, match="must be aborted") as caught:
        producer.commit()
    assert caught.value.retryable
    assert f"{ready.prefix}.missing" in str(caught.value)

    producer.abort()
    producer.begin()
    producer.produce(topic, "tx-1", b"retried")
    producer.commit()
    assert [m.value for m in read_topic(ready, topic)] == [b"retried"]


# --------------------------------------------------------------------------- dead letters


def test_dead_letter_keeps_the_bytes_and_names_the_error(
    ready: KafkaSettings, closing: Callable[[Producer], None]
) -> None:
    topics = ready.topics
    rejected = Message(
        topic=topics.requests,
        partition=2,
        offset=41,
        key=b"\xff\xfe not utf-8",
        value=b"{not json",
    )
    producer = Producer(ready)
    closing(producer)
    send_to_dlq(
        producer,
        topics,
        rejected,
        "not JSON: unexpected character at 1",
        component="coordinator",
        at_ms=1_700_000_000_000,
    )
    producer.flush(10)

    (letter,) = read_topic(ready, topics.dlq)
    assert letter.key == rejected.key
    assert letter.value == rejected.value
    assert dict(letter.headers) == {
        "saga.error": b"not JSON: unexpected character at 1",
        "saga.source.topic": topics.requests.encode(),
        "saga.source.partition": b"2",
        "saga.source.offset": b"41",
        "saga.component": b"coordinator",
        "saga.rejected.at_ms": b"1700000000000",
    }


def test_wait_for_broker_names_the_address_when_nothing_answers() -> None:
    nowhere = KafkaSettings(bootstrap="127.0.0.1:1")
    started = time.monotonic()
    with pytest.raises(SagaError, match=r"Kafka at 127\.0\.0\.1:1 does not answer") as caught:
        wait_for_broker(nowhere, timeout=2)
    assert caught.value.retryable
    assert time.monotonic() - started < 10
