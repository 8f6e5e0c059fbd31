"""A record Kafka acknowledges without an offset is sent again, never reported delivered.

librdkafka 2.x has been seen (chaos isolation tier, just after a broker restart) to report
the first records to a partition of a new topic as delivered at offset -1 while no such
record was in the log: a client that believed it lost the saga. The plain producer sends
such a record again, a few times, then fails its delivery as "may not be in the log".
"""

from __future__ import annotations

from typing import Any

import confluent_kafka as ck
import pytest

from saga.streams import KafkaSettings, SagaError, TransientError
from saga.streams.kafka import Message
from saga.streams.kafka import _producer as P

SETTINGS = KafkaSettings(bootstrap="nowhere:9092", prefix="u")


class _Raw:
    """What librdkafka hands a delivery report: the record and where it went."""

    def __init__(self, sent: dict[str, Any], offset: int | None) -> None:
        self.sent, self._offset = sent, offset

    def topic(self) -> str:
        return str(self.sent["topic"])

    def partition(self) -> int:
        return 3

    def offset(self) -> int | None:
        return self._offset

    def key(self) -> Any:
        return self.sent["key"]

    def value(self) -> Any:
        return self.sent["value"]

    def headers(self) -> Any:
        return self.sent["headers"]

    def timestamp(self) -> tuple[int, int]:
        return ck.TIMESTAMP_CREATE_TIME, 1


class _Client:
    """Stands in for librdkafka's producer: keeps each record and its delivery callback."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def produce(self, topic: str, **kw: Any) -> None:
        self.sent.append({"topic": topic, **kw})

    def ack(self, index: int, offset: int | None) -> None:
        record = self.sent[index]
        record["on_delivery"](None, _Raw(record, offset))

    def poll(self, _timeout: float) -> int:
        return 0

    def flush(self, _timeout: float) -> int:
        return 0


def _producer() -> tuple[P.Producer, _Client]:
    producer = P.Producer(SETTINGS)
    client = _Client()
    producer._client = client  # type: ignore[assignment]
    return producer, client


def test_an_ack_without_offset_sends_the_same_record_again_and_reports_the_placed_one() -> None:
    producer, client = _producer()
    reports: list[tuple[SagaError | None, Message]] = []
    producer.produce("u.requests", "tx-1", b"v", [("h", b"1")], lambda e, m: reports.append((e, m)))
    client.ack(0, -1)
    assert reports == []
    assert len(client.sent) == 2
    first, again = client.sent
    for field in ("topic", "key", "value", "headers"):
        assert again[field] == first[field]
    client.ack(1, 17)
    ((error, message),) = reports
    assert error is None
    assert (message.partition, message.offset) == (3, 17)
    assert producer.flush(0) == 1  # one record delivered, not two


def test_an_ack_without_offset_after_the_resends_fails_the_delivery() -> None:
    producer, client = _producer()
    reports: list[tuple[SagaError | None, Message]] = []
    producer.produce("u.requests", "tx-2", b"v", None, lambda e, m: reports.append((e, m)))
    for index in range(P._UNPLACED_RESENDS + 1):
        assert reports == []
        client.ack(index, None)
    assert len(client.sent) == P._UNPLACED_RESENDS + 1
    ((error, _),) = reports
    assert isinstance(error, TransientError)
    assert "without an offset" in str(error) and "may not be in the log" in str(error)


def test_without_a_callback_an_unplaced_record_is_raised_by_flush() -> None:
    producer, client = _producer()
    producer.produce("u.registry", "ledger", b"v")
    for index in range(P._UNPLACED_RESENDS + 1):
        client.ack(index, -1)
    with pytest.raises(TransientError, match="may not be in the log"):
        producer.flush(0)


def test_a_placed_record_is_reported_once_and_never_sent_again() -> None:
    producer, client = _producer()
    reports: list[tuple[SagaError | None, Message]] = []
    producer.produce("u.requests", "tx-3", b"v", None, lambda e, m: reports.append((e, m)))
    client.ack(0, 0)
    assert len(client.sent) == 1
    assert [(e, m.offset) for e, m in reports] == [(None, 0)]
