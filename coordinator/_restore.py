"""Rebuilding a coordinator's state from the status topic (when it is assigned partitions).

The status topic is compacted and keyed by ``tx_id``; its partition ``p`` holds the
statuses of the transactions whose requests and events are on partition ``p`` of
the other topics. :func:`restore` reads the given partitions to their end and
returns, per partition, the sagas whose latest status stands: a tombstone means the
saga was forgotten (retention); a record that does not decode is passed over.

With keys, the latest record *the coordinator signed* stands: a transaction's
records are kept and verified lazily, newest first, until one is valid (a forged
one is reported to ``on_forged`` and skipped), so a restart verifies about one
record per transaction, not every record read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

from saga.coordinator._machine import Saga
from saga.coordinator._txn import retrying
from saga.streams import InvalidRecord, SagaStatus
from saga.streams._codec import decode_keyed
from saga.streams._signing import COORDINATOR, Keyring
from saga.streams.kafka import Message
from saga.streams.log import Log, LogConsumer

log = logging.getLogger("saga.coordinator")

_ONLY_COORDINATOR = frozenset({COORDINATOR})
_END_WITHIN_S: Final = 60.0
"""How long the end of a status partition is asked for: its leader may be moving (an
election takes seconds); giving up at the first time-out cost a restart."""


def restore(
    log: Log,
    topic: str,
    partitions: list[int],
    *,
    client_id: str,
    keys: Keyring | None,
    on_forged: Callable[[Message, str], None],
) -> dict[int, list[Saga]]:
    """The sagas of the status topic's ``partitions``, as their latest standing status says."""
    restored: dict[int, list[Saga]] = {p: [] for p in partitions}
    for p, by_key in _read(log, topic, partitions, client_id).items():
        for records in by_key.values():
            found, status = standing_status(records, keys, on_forged)
            if found and status is not None:  # a tombstone: the saga was forgotten
                restored[p].append(Saga.from_status(status))
    return restored


def standing_status(
    records: Sequence[Message],
    keys: Keyring | None,
    on_forged: Callable[[Message, str], None],
) -> tuple[bool, SagaStatus | None]:
    """The status that stands among one transaction's ``records`` (oldest first).

    Newest first: a record that does not decode is passed over; with ``keys``, one
    the coordinator did not sign is reported to ``on_forged`` and passed over. The
    first other one stands: ``(True, status)``, or ``(True, None)`` for a tombstone.
    ``(False, None)`` when none does.
    """
    for m in reversed(records):
        status: SagaStatus | None = None
        if m.value is not None:
            try:
                decoded = decode_keyed(m.key, m.value, SagaStatus)
            except InvalidRecord:
                continue
            assert isinstance(decoded, SagaStatus)
            status = decoded
        if keys is not None:
            reason = keys.check(m.topic, m.key, m.value, m.headers, _ONLY_COORDINATOR)
            if reason is not None:
                on_forged(m, reason)
                continue
        return True, status
    return False, None


def _read(
    log: Log, topic: str, partitions: list[int], client_id: str
) -> dict[int, dict[bytes, list[Message]]]:
    """Every record of ``topic``'s ``partitions`` per key, oldest first, to their end."""
    found: dict[int, dict[bytes, list[Message]]] = {p: {} for p in partitions}
    reader = log.consumer(None, client_id=client_id)
    try:
        ends = {p: _end_of(reader, topic, p) for p in partitions}
        todo = {p for p in partitions if ends[p] > 0}
        reader.assign([(topic, p, 0) for p in todo])
        while todo:
            for m in reader.poll_batch(5000, 0.5):
                if m.key is not None:
                    found[m.partition].setdefault(m.key, []).append(m)
                if m.offset + 1 >= ends[m.partition]:
                    todo.discard(m.partition)
            # Transaction markers occupy offsets too: the position tells when we are done.
            for (_, p), pos in reader.position([(topic, p) for p in todo]).items():
                if pos is not None and pos >= ends[p]:
                    todo.discard(p)
    finally:
        reader.close()
    return found


def _end_of(reader: LogConsumer, topic: str, partition: int) -> int:
    """The high watermark of ``topic [partition]``, retried with backoff for a minute."""
    return retrying(
        "restore",
        lambda: reader.watermarks(topic, partition)[1],
        within_s=_END_WITHIN_S,
        max_delay_s=4.0,
    )
