"""The coordinator knows its own records, read back, by the place Kafka gave them.

``coordinator._own.OwnRecords`` remembers the topic, partition and offset of each
record its delivery reports name, with a keyed hash of its key and value. A record
read at a remembered place with the same key and value is the coordinator's own and
needs no signature check; anything else (another place, another content at the place,
a place forgotten) is checked as before. Forged status records are still dead-lettered
(``tests/unit/test_signed_services.py``), and the coordinator's checks per saga are
counted in ``tests/unit/test_signing_costs.py``.
"""

from __future__ import annotations

import pytest

from saga.coordinator._own import OwnRecords
from saga.streams import TransientError
from saga.streams.kafka import Message

pytestmark = pytest.mark.unit


def record(offset: int, value: bytes = b'{"state":"committed"}', key: bytes = b"tx-1") -> Message:
    return Message(topic="saga.status", partition=2, offset=offset, key=key, value=value)


def test_a_delivered_record_is_known_once_when_read_back() -> None:
    own = OwnRecords(10)
    own.delivered(None, record(7))
    assert len(own) == 1
    assert own.read_back(record(7))
    assert own.recognised == 1
    # Read again (a rebalance reads it twice): checked like any other record.
    assert not own.read_back(record(7))
    assert len(own) == 0


def test_another_content_at_a_remembered_place_is_not_own() -> None:
    """A topic deleted and created again starts its offsets over: the place is not enough."""
    own = OwnRecords(10)
    own.delivered(None, record(3))
    assert not own.read_back(record(3, value=b'{"state":"rolled_back"}'))
    own.delivered(None, record(4))
    assert not own.read_back(record(4, key=b"tx-2"))
    assert own.recognised == 0


def test_another_place_another_topic_or_partition_is_not_own() -> None:
    own = OwnRecords(10)
    own.delivered(None, record(5))
    elsewhere = [
        record(6),
        Message(topic="saga.decisions", partition=2, offset=5, key=b"tx-1", value=record(5).value),
        Message(topic="saga.status", partition=1, offset=5, key=b"tx-1", value=record(5).value),
    ]
    assert not any(own.read_back(m) for m in elsewhere)
    assert own.read_back(record(5))


def test_failed_or_unplaced_deliveries_are_not_remembered() -> None:
    own = OwnRecords(10)
    own.delivered(TransientError("not delivered"), record(1))
    own.delivered(None, record(-1))
    assert len(own) == 0
    assert not own.read_back(record(1))


def test_the_memory_is_bounded_and_forgets_the_oldest_place_first() -> None:
    own = OwnRecords(3)
    for offset in range(5):
        own.delivered(None, record(offset))
    assert len(own) == 3
    assert own.forgotten == 2
    assert not own.read_back(record(0))  # forgotten: checked by signature instead
    assert not own.read_back(record(1))
    assert all(own.read_back(record(offset)) for offset in (2, 3, 4))
