"""Rebuilding a coordinator's state from the status topic (when it is assigned partitions).

The status topic is compacted and keyed by ``tx_id``; its partition ``p`` holds the
statuses of the transactions whose requests and events are on partition ``p`` of
the other topics. :func:`restore` reads the given partitions to their end and keeps,
per transaction, the latest status that stands: a tombstone means the saga was
forgotten (retention); a record that does not decode is passed over. A saga in flight
goes to memory, a finished one to its partition's table on disk
(:mod:`coordinator._finished`), so a restore after millions of sagas holds in memory
only those in flight and the batch being read.

The records are read in batches, and within a batch each transaction's records
newest first, until one stands: an older one is not even decoded. A finished status
(``committed`` or ``rolled_back``, its request seen) is checked field by field for what
the coordinator reads from it (:func:`_glance`: a JSON object of the status type and
wire version, keyed by its ``tx_id``, every field of the right type, states and step
states the contract knows); the others are decoded in full (:func:`~streams.decode_keyed`).

With keys, the latest record *the coordinator signed* stands; a forged one is skipped
and reported to ``on_forged`` if it is newer than the one that stands (as a reader
looking newest first would meet it). Records signed together share one verification.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import orjson

from saga.coordinator._finished import FINISHED, FinishedLoader
from saga.coordinator._machine import Saga
from saga.coordinator._reading import read_ahead_capped
from saga.coordinator._retention import ForgetAt, PartitionState
from saga.coordinator._txn import retrying
from saga.streams import InvalidRecord, SagaState, SagaStatus, StepStatus
from saga.streams._codec import decode_keyed
from saga.streams._limits import MAX_RECORD_BYTES
from saga.streams._records import WIRE_VERSION
from saga.streams._signing import COORDINATOR, Keyring
from saga.streams.kafka import Message
from saga.streams.log import Log, LogConsumer

__all__ = ["restore", "standing_record", "standing_status"]

log = logging.getLogger("saga.coordinator")

_ONLY_COORDINATOR = frozenset({COORDINATOR})
_END_WITHIN_S: Final = 60.0
"""How long the end of a status partition is asked for: its leader may be moving (an
election takes seconds); giving up at the first time-out cost a restart."""
_BATCH: Final = 5000
_READ_AHEAD_KIB: Final = 8192  # the reader keeps nothing but a batch: no need of 64 MiB

OnForged = Callable[[Message, str], None]


def restore(
    log: Log,
    topic: str,
    parts: Mapping[int, PartitionState],
    *,
    client_id: str,
    keys: Keyring | None,
    on_forged: OnForged,
    forget_at: ForgetAt,
) -> None:
    """Fill ``parts`` (new, empty) with the sagas of the status topic's partitions."""
    fills = {p: _Fill(part, keys, forget_at) for p, part in parts.items()}
    reader = read_ahead_capped(log, _READ_AHEAD_KIB).consumer(None, client_id=client_id)
    try:
        ends = {p: _end_of(reader, topic, p) for p in parts}
        todo = {p for p in parts if ends[p] > 0}
        reader.assign([(topic, p, 0) for p in todo])
        while todo:
            read: dict[int, list[Message]] = {}
            for m in reader.poll_batch(_BATCH, 0.5):
                read.setdefault(m.partition, []).append(m)
                if m.offset + 1 >= ends[m.partition]:
                    todo.discard(m.partition)
            for p, records in read.items():
                fills[p].batch(records)
            # Transaction markers occupy offsets too: the position tells when we are done.
            for (_, p), pos in reader.position([(topic, p) for p in todo]).items():
                if pos is not None and pos >= ends[p]:
                    todo.discard(p)
    finally:
        reader.close()
    for fill in fills.values():
        fill.finish(on_forged)
    _give_back_memory()


class _Fill:
    """One partition's restore: what stands so far, per transaction."""

    def __init__(self, part: PartitionState, keys: Keyring | None, forget_at: ForgetAt) -> None:
        self._live = part.sagas.live
        self._disk: FinishedLoader = part.sagas.finished.loader()
        self._keys = keys
        self._forget_at = forget_at
        # Forged records newer than what stands for their transaction, reported at the end.
        self._forged: dict[bytes, list[tuple[Message, str]]] = {}

    def batch(self, records: Sequence[Message]) -> None:
        by_key: dict[bytes, list[Message]] = {}
        for m in records:
            if m.key is not None:
                by_key.setdefault(m.key, []).append(m)
        for key, kept in by_key.items():
            self._stand(key, kept)

    def _stand(self, key: bytes, records: list[Message]) -> None:
        """Apply the newest of ``records`` (one transaction's, oldest first) that stands."""
        forged: list[tuple[Message, str]] = []
        for m in reversed(records):
            found = self._read(m)
            if found is None:
                continue
            if self._keys is not None:
                reason = self._keys.check(m.topic, m.key, m.value, m.headers, _ONLY_COORDINATOR)
                if reason is not None:
                    forged.append((m, reason))
                    continue
            if forged:
                self._forged[key] = forged  # those under it are never looked at
            else:
                self._forged.pop(key, None)
            tx_id = key.decode("utf-8", "replace")
            if found is _TOMBSTONE:
                self._live.pop(tx_id, None)
                self._disk.gone(tx_id)
            elif isinstance(found, Saga) and (at := self._finished_at(found)) is not None:
                self._live.pop(tx_id, None)
                self._disk.finished(found, at)
            else:
                assert isinstance(found, Saga)
                self._live[tx_id] = found
                self._disk.gone(tx_id)
            return
        if forged:
            self._forged.setdefault(key, []).extend(forged)

    def _finished_at(self, saga: Saga) -> int | None:
        if not saga.request_seen or saga.state not in FINISHED:
            return None
        return self._forget_at(saga)

    def _read(self, m: Message) -> Saga | object | None:
        """What ``m`` says: a saga, :data:`_TOMBSTONE`, or None (it does not decode)."""
        if m.value is None:
            return _TOMBSTONE
        data = _glance(m.key or b"", m.value)
        if data is None:
            return None
        state = SagaState(data["state"])
        fingerprint = data.get("fingerprint")
        if state in FINISHED and fingerprint is not None:
            steps = data["steps"]
            return Saga.ended(
                tx_id=data["tx_id"],
                saga=data["saga"],
                state=state,
                participants=tuple(s["participant"] for s in steps),
                steps=tuple(StepStatus(s["status"]) for s in steps),
                confirms=tuple(s.get("confirm", False) for s in steps),
                reason=data.get("reason"),
                created_ms=data["created_ms"],
                updated_ms=data["updated_ms"],
                deadline_ms=data["deadline_ms"],
                fingerprint=fingerprint,
            )
        try:  # in flight: few of them, decoded in full
            status = decode_keyed(m.key, m.value, SagaStatus)
        except InvalidRecord:
            return None
        assert isinstance(status, SagaStatus)
        return Saga.from_status(status)

    def finish(self, on_forged: OnForged) -> None:
        self._disk.finish()
        for forged in self._forged.values():
            for m, reason in forged:
                on_forged(m, reason)


_TOMBSTONE: Final = object()

_STATES: Final = frozenset(s.value for s in SagaState)
_STEP_STATES: Final = frozenset(s.value for s in StepStatus)
_TIMES: Final = ("created_ms", "updated_ms", "deadline_ms")


def _glance(key: bytes, value: bytes) -> dict[str, Any] | None:
    """``value`` parsed, if it is a status record keyed ``key`` whose fields have the types
    and values the coordinator reads from it; else None."""
    if len(key) + len(value) > MAX_RECORD_BYTES:
        return None
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    if type(data) is not dict or data.get("type") != "saga.status":
        return None
    if type(data.get("v")) is not int or data["v"] != WIRE_VERSION:
        return None
    tx_id, state, steps = data.get("tx_id"), data.get("state"), data.get("steps")
    if type(tx_id) is not str or tx_id.encode("utf-8", "replace") != key:
        return None
    if type(state) is not str or state not in _STATES or type(steps) is not list:
        return None
    if any(type(data.get(t)) is not int for t in _TIMES) or type(data.get("saga")) is not str:
        return None
    if not all(type(data.get(f)) in (str, type(None)) for f in ("reason", "fingerprint")):
        return None
    for step in steps:
        if (
            type(step) is not dict
            or type(step.get("participant")) is not str
            or type(step.get("status")) is not str
            or step["status"] not in _STEP_STATES
            or type(step.get("confirm", False)) is not bool
        ):
            return None
    return data


def standing_status(
    records: Sequence[Message],
    keys: Keyring | None,
    on_forged: OnForged,
) -> tuple[bool, SagaStatus | None]:
    """The status that stands among one transaction's ``records`` (oldest first).

    Newest first: a record that does not decode is passed over; with ``keys``, one
    the coordinator did not sign is reported to ``on_forged`` and passed over. The
    first other one stands: ``(True, status)``, or ``(True, None)`` for a tombstone.
    ``(False, None)`` when none does.
    """
    stood = standing_record(records, keys, on_forged)
    return (False, None) if stood is None else (True, stood[1])


def standing_record(
    records: Sequence[Message],
    keys: Keyring | None,
    on_forged: OnForged,
) -> tuple[Message, SagaStatus | None] | None:
    """As :func:`standing_status`, with the record that stands: ``(record, status)``
    (``status`` None for a tombstone), or None when none does."""
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
        return m, status
    return None


def _read(
    log: Log, topic: str, partitions: list[int], client_id: str
) -> dict[int, dict[bytes, list[Message]]]:
    """Every record of ``topic``'s ``partitions`` per key, oldest first, to their end (all
    in memory: for ``saga list``, which shows them all)."""
    found: dict[int, dict[bytes, list[Message]]] = {p: {} for p in partitions}
    reader = log.consumer(None, client_id=client_id)
    try:
        ends = {p: _end_of(reader, topic, p) for p in partitions}
        todo = {p for p in partitions if ends[p] > 0}
        reader.assign([(topic, p, 0) for p in todo])
        while todo:
            for m in reader.poll_batch(_BATCH, 0.5):
                if m.key is not None:
                    found[m.partition].setdefault(m.key, []).append(m)
                if m.offset + 1 >= ends[m.partition]:
                    todo.discard(m.partition)
            for (_, p), pos in reader.position([(topic, p) for p in todo]).items():
                if pos is not None and pos >= ends[p]:
                    todo.discard(p)
    finally:
        reader.close()
    return found


def _give_back_memory() -> None:
    """Return to the system the heap a restore used and freed: glibc keeps freed memory
    in its arenas (the Kafka client's read buffers of millions of records among it),
    where it would stay counted in the process's resident memory. Elsewhere, nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return
    trim(0)


def _end_of(reader: LogConsumer, topic: str, partition: int) -> int:
    """The high watermark of ``topic [partition]``, retried with backoff for a minute."""
    return retrying(
        "restore",
        lambda: reader.watermarks(topic, partition)[1],
        within_s=_END_WITHIN_S,
        max_delay_s=4.0,
    )
