"""Dead letters for operators: list them, read one, redrive it to its source topic.

Part of the admin library (re-exported by :mod:`coordinator._admin`): plain
functions over a :class:`streams.log.Log` or :class:`~streams.kafka.KafkaSettings`.
A dead letter (:func:`streams.kafka.send_to_dlq`) keeps the rejected record's key
and value and names the rejection in ``saga.*`` headers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from saga.coordinator._reading import read_to
from saga.streams import ConfigurationError
from saga.streams._signing import HEADER_PROOF, HEADER_SIGNATURE
from saga.streams.kafka import KafkaLog, KafkaSettings, Message
from saga.streams.log import Log

__all__ = ["REDRIVEN_BY", "REDRIVEN_FROM", "DeadLetter", "dead_letter", "dead_letters", "redrive"]

REDRIVEN_FROM = "saga.redriven.from"
"""Header of a redriven record: ``<dlq partition>:<dlq offset>`` of the dead letter copied."""
REDRIVEN_BY = "saga.redriven.by"
"""Header of a redriven record: the operator who redrove it."""


def _log_of(source: Log | KafkaSettings) -> Log:
    return KafkaLog(source) if isinstance(source, KafkaSettings) else source


def _text_headers(headers: Sequence[tuple[str, bytes]]) -> dict[str, str]:
    shown: dict[str, str] = {}
    for name, value in headers:
        binary = name in (HEADER_SIGNATURE, HEADER_PROOF)
        shown[name] = value.hex() if binary else value.decode("utf-8", "replace")
    return shown


@dataclass(frozen=True)
class DeadLetter:
    """A record on the DLQ: where it came from, why it was rejected, its bytes."""

    partition: int
    offset: int
    timestamp_ms: int | None
    key: bytes | None
    value: bytes | None
    headers: dict[str, str]
    source_topic: str | None
    source_partition: int | None
    source_offset: int | None
    reason: str
    component: str | None
    truncated: bool

    @property
    def where(self) -> str:
        """``<partition>:<offset>``, how the commands name a dead letter."""
        return f"{self.partition}:{self.offset}"

    @property
    def tx_ids(self) -> tuple[str, ...]:
        """The transactions the rejected record names: its key, and for a
        ``saga.committed`` (steps of several transactions under the first one's key)
        every transaction it lists, each once, in order."""
        named = [_text(self.key)[0]] if self.key is not None else []
        for tx_id in _listed(self.value):
            if tx_id not in named:
                named.append(tx_id)
        return tuple(named)

    def to_json(self, *, full: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; ``full`` adds the key and value as text (or hex).

        ``tx_id`` is the key; ``tx_ids`` every transaction the record names
        (:attr:`tx_ids`: more than the key for a ``saga.committed``)."""
        shown: dict[str, Any] = {
            "dlq": self.where,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "tx_id": _text(self.key)[0] if self.key is not None else None,
            "tx_ids": list(self.tx_ids),
            "source_topic": self.source_topic,
            "source_partition": self.source_partition,
            "source_offset": self.source_offset,
            "reason": self.reason,
            "component": self.component,
            "truncated": self.truncated,
        }
        if full:
            for name, data in (("key", self.key), ("value", self.value)):
                text, encoding = _text(data) if data is not None else (None, None)
                shown[name] = text
                shown[f"{name}_encoding"] = encoding
            shown["headers"] = self.headers
        return shown


def _listed(value: bytes | None) -> list[str]:
    """The ``tx_id`` of each step a ``saga.committed`` value lists (loosely: the value
    may break the contract, that may be why it is here); ``[]`` for any other value."""
    if value is None or (b"saga.committed" not in value and b"\\u" not in value):
        return []
    try:
        record = orjson.loads(value)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(record, dict) or record.get("type") != "saga.committed":
        return []
    steps = record.get("steps")
    if not isinstance(steps, list):
        return []
    return [s[0] for s in steps if isinstance(s, list) and s and isinstance(s[0], str)]


def _text(data: bytes) -> tuple[str, str]:
    """``data`` as UTF-8 text when it is, else as hex; with which one it is."""
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return data.hex(), "hex"


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _dead_letter_of(m: Message) -> DeadLetter:
    headers = _text_headers(m.headers)
    return DeadLetter(
        partition=m.partition,
        offset=m.offset,
        timestamp_ms=m.timestamp_ms,
        key=m.key,
        value=m.value,
        headers=headers,
        source_topic=headers.get("saga.source.topic"),
        source_partition=_int_or_none(headers.get("saga.source.partition")),
        source_offset=_int_or_none(headers.get("saga.source.offset")),
        reason=headers.get("saga.error", "no reason recorded"),
        component=headers.get("saga.component"),
        truncated=headers.get("saga.truncated") == "1",
    )


def dead_letters(
    log_or_settings: Log | KafkaSettings,
    *,
    source_topic: str | None = None,
    since_ms: int | None = None,
    limit: int | None = None,
    timeout: float = 10.0,
) -> list[DeadLetter]:
    """The DLQ's records, newest first: those from ``source_topic`` (a full topic name or
    its suffix such as ``requests``), written at or after ``since_ms``; at most ``limit``.
    """
    log = _log_of(log_or_settings)
    topic = log.settings.topics.dlq
    reader = log.consumer(None, client_id="saga.admin.dlq")
    found: list[Message] = []
    try:
        ends: dict[tuple[str, int], int] = {}
        start: list[tuple[str, int, int]] = []
        for p in range(reader.list_partitions(topic, timeout)):
            low, high = reader.watermarks(topic, p, timeout)
            if high > low:
                ends[(topic, p)] = high
                start.append((topic, p, low))
        if start:
            reader.assign(start)
        found = read_to(reader, ends, timeout)
    finally:
        reader.close()
    prefix = log.settings.topics.prefix
    wanted = None
    if source_topic is not None:
        wanted = source_topic if "." in source_topic else f"{prefix}.{source_topic}"
    letters = [
        d
        for d in map(_dead_letter_of, found)
        if (wanted is None or d.source_topic == wanted)
        and (since_ms is None or (d.timestamp_ms or 0) >= since_ms)
    ]
    letters.sort(key=lambda d: (d.timestamp_ms or 0, d.partition, d.offset), reverse=True)
    return letters if limit is None else letters[:limit]


def dead_letter(
    log_or_settings: Log | KafkaSettings, partition: int, offset: int, *, timeout: float = 10.0
) -> DeadLetter | None:
    """The dead letter at ``partition:offset`` of the DLQ, or ``None`` if there is none."""
    log = _log_of(log_or_settings)
    topic = log.settings.topics.dlq
    reader = log.consumer(None, client_id="saga.admin.dlq")
    try:
        if not 0 <= partition < reader.list_partitions(topic, timeout):
            return None
        low, high = reader.watermarks(topic, partition, timeout)
        if not low <= offset < high:
            return None
        reader.assign([(topic, partition, offset)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in reader.poll_batch(1, 0.2):
                return _dead_letter_of(m) if m.offset == offset else None
            pos = reader.position([(topic, partition)]).get((topic, partition))
            if pos is not None and pos > offset:
                return None  # a transaction marker or an aborted record: no dead letter
    finally:
        reader.close()
    return None


def redrive(
    log_or_settings: Log | KafkaSettings, letter: DeadLetter, *, by: str
) -> tuple[str, int, int]:
    """Produce ``letter``'s original key and value to its source topic again.

    The copy carries :data:`REDRIVEN_FROM` and :data:`REDRIVEN_BY` and none of the
    dead letter's ``saga.*`` headers. A dead letter does not keep the original's
    headers, so the copy is unsigned: where signatures are checked, the consumer
    rejects it again (a redrive cannot launder a record). Returns
    ``(topic, partition, offset)`` of the copy.

    Raises :class:`ConfigurationError` for a truncated dead letter (its bytes are
    not the whole record) or one whose source topic is not a topic of this
    deployment.
    """
    log = _log_of(log_or_settings)
    topics = log.settings.topics
    if letter.truncated:
        raise ConfigurationError(
            f"dead letter {letter.where} holds only the start of a record that was too large, "
            "so it cannot be redriven; ask its producer to send it again"
        )
    source = letter.source_topic
    if source not in (topics.requests, topics.events, topics.decisions):
        raise ConfigurationError(
            f"dead letter {letter.where} came from {source or 'an unknown topic'}, not from "
            f"{topics.requests}, {topics.events} or {topics.decisions}; it cannot be redriven"
        )
    # The dead letter's own headers (saga.*) describe the rejection, and its signature
    # (if any) is the coordinator's over the dead letter: neither belongs on the copy.
    headers = [
        *((n, v.encode()) for n, v in letter.headers.items() if not n.startswith("saga.")),
        (REDRIVEN_FROM, letter.where.encode()),
        (REDRIVEN_BY, by.encode()),
    ]
    delivered: list[Message] = []
    errors: list[str] = []

    def done(error: object, m: Message) -> None:
        if error is not None:
            errors.append(str(error))
        else:
            delivered.append(m)

    with log.producer(client_id="saga.admin.redrive") as producer:
        producer.produce(source, letter.key, letter.value, headers=headers, on_delivery=done)
        producer.flush(30)
    if errors or not delivered:
        raise ConfigurationError(
            f"the copy of dead letter {letter.where} was not delivered "
            f"({errors[0] if errors else 'no answer from Kafka'}); try again"
        )
    return source, delivered[0].partition, delivered[0].offset
