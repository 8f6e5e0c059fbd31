"""Keys to partitions, and dead letters: where a record goes, and where a bad one ends up."""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

import confluent_kafka as ck

from saga.streams._limits import DLQ_EXCERPT_BYTES, MAX_RECORD_BYTES
from saga.streams._topics import Topics
from saga.streams.kafka._message import Message

if TYPE_CHECKING:
    from saga.streams.log import LogProducer


def partition_for(key: str | bytes, partitions: int) -> int:
    """The partition a record with ``key`` goes to among ``partitions`` (Java-compatible murmur2).

    The same number for every saga topic (they share the partition count), for
    the producers of this package and for JVM clients with the default partitioner.
    """
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, not {partitions}")
    return ck.murmur2(key.encode() if isinstance(key, str) else key, partitions)


# --------------------------------------------------------------------------- dead letters


def send_to_dlq(
    producer: LogProducer,
    topics: Topics,
    message: Message,
    reason: str,
    *,
    component: str,
    at_ms: int | None = None,
) -> None:
    """Queue ``message``'s original key and value bytes on the dead-letter topic.

    Headers (UTF-8 strings): ``saga.error`` (``reason``), ``saga.source.topic``,
    ``saga.source.partition``, ``saga.source.offset``, ``saga.component`` and
    ``saga.rejected.at_ms`` (``at_ms``, default now). Through a
    :class:`TransactionalProducer` inside a transaction, the dead letter is
    written atomically with the offsets that skip the record. Like
    :meth:`Producer.produce` this only queues: flush or commit to be sure.

    A record larger than :data:`~streams._limits.MAX_RECORD_BYTES` (key and value
    together) could exceed what the producer or the broker accepts once headers are
    added, so it is not copied whole: the dead letter holds the first
    :data:`~streams._limits.DLQ_EXCERPT_BYTES` bytes of the key and of the value, and
    the headers ``saga.truncated`` (``1``), ``saga.source.key.length``,
    ``saga.source.value.length`` and ``saga.source.sha256`` (hex digest of the value)
    describe the original.
    """
    stamp = at_ms if at_ms is not None else int(time.time() * 1000)
    headers = [
        ("saga.error", reason.encode()),
        ("saga.source.topic", message.topic.encode()),
        ("saga.source.partition", str(message.partition).encode()),
        ("saga.source.offset", str(message.offset).encode()),
        ("saga.component", component.encode()),
        ("saga.rejected.at_ms", str(stamp).encode()),
    ]
    key, value = message.key, message.value
    size = len(key or b"") + len(value or b"")
    if size > MAX_RECORD_BYTES:
        headers += [
            ("saga.truncated", b"1"),
            ("saga.source.key.length", str(len(key or b"")).encode()),
            ("saga.source.value.length", str(len(value or b"")).encode()),
            ("saga.source.sha256", hashlib.sha256(value or b"").hexdigest().encode()),
        ]
        key = key[:DLQ_EXCERPT_BYTES] if key is not None else None
        value = value[:DLQ_EXCERPT_BYTES] if value is not None else None
    producer.produce(topics.dlq, key, value, headers=headers)
