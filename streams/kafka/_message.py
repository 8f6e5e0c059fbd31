"""What crosses the boundary from confluent-kafka: records, partitions, offsets.

Every offset taken or returned for committing, resuming or positioning is the
next offset to read (see :mod:`streams.kafka`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, TypeGuard

import confluent_kafka as ck

from saga.streams._errors import SagaError

Partition = tuple[str, int]
"""A partition as ``(topic, partition number)``."""

RebalanceCallback = Callable[[list[Partition]], None]
"""Called with the partitions assigned, revoked or lost by a group rebalance."""

DeliveryCallback = Callable[["SagaError | None", "Message"], None]
"""Called once per produced record: ``(None, record)`` when the broker acknowledged it
(``record.offset`` is then its offset), ``(error, record)`` when it was not delivered."""

OFFSET_BEGINNING: Final = ck.OFFSET_BEGINNING
"""For :meth:`Consumer.assign`: start at the oldest record the partition still holds."""
OFFSET_END: Final = ck.OFFSET_END
"""For :meth:`Consumer.assign`: start after the newest record (read only new ones)."""


@dataclass(frozen=True, slots=True)
class Message:
    """A consumed (or delivered) record, copied out of the client library.

    ``offset`` is the record's own offset; the offset to commit after processing
    it is :attr:`next_offset`. ``timestamp_ms`` is ``None`` when the broker gave
    none. Header values that were null arrive as ``b""``.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp_ms: int | None = None

    @property
    def next_offset(self) -> int:
        """The offset to commit once this record is processed: ``offset + 1``."""
        return self.offset + 1

    @property
    def partition_key(self) -> Partition:
        """``(topic, partition)``, the key of the offset mappings of this package."""
        return (self.topic, self.partition)

    def header(self, name: str) -> bytes | None:
        """The value of the last header called ``name``, or ``None``."""
        found: bytes | None = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found


def _to_message(raw: ck.Message) -> Message:
    raw_headers = raw.headers() or []
    pairs = tuple(raw_headers.items() if isinstance(raw_headers, Mapping) else raw_headers)
    # Done for every record read: confluent-kafka's (str, bytes) pairs are taken as they
    # are (one copy in C) unless a value is null or text.
    headers = (
        pairs
        if _all_bytes(pairs)
        else tuple(
            (name, value.encode() if isinstance(value, str) else (value or b""))
            for name, value in pairs
        )
    )
    kind, stamp = raw.timestamp()
    partition = raw.partition()
    offset = raw.offset()
    return Message(
        topic=raw.topic() or "",
        partition=-1 if partition is None else partition,
        offset=-1 if offset is None else offset,
        key=raw.key(),
        value=raw.value(),
        headers=headers,
        timestamp_ms=None if kind == ck.TIMESTAMP_NOT_AVAILABLE else stamp,
    )


def _all_bytes(
    pairs: tuple[tuple[str, str | bytes | None], ...],
) -> TypeGuard[tuple[tuple[str, bytes], ...]]:
    return all([value.__class__ is bytes for _, value in pairs])


def _tps(partitions: Iterable[Partition]) -> list[ck.TopicPartition]:
    return [ck.TopicPartition(topic, partition) for topic, partition in partitions]


def _tps_at(offsets: Mapping[Partition, int]) -> list[ck.TopicPartition]:
    return [ck.TopicPartition(topic, part, offset) for (topic, part), offset in offsets.items()]


def _offset_or_none(offset: int) -> int | None:
    # librdkafka reports "no offset" as a negative logical offset (OFFSET_INVALID).
    return offset if offset >= 0 else None
