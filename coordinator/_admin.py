"""What an operator reads from the log: one saga's history, sagas by state, dead letters.

The dead letters live in :mod:`coordinator._admin_dlq` and are re-exported here.

Plain functions over a :class:`streams.log.Log` (or the
:class:`~streams.kafka.KafkaSettings` to make a :class:`~streams.kafka.KafkaLog` of),
shared by the ``saga`` admin commands (:mod:`coordinator._cli_admin`) and the web
console. They only read, except :func:`redrive` and :func:`send_resolve`, which
append operator records; none of them changes a record that is there.

Everything read is hostile until decoded: a record that does not decode is shown
as ``invalid`` with the codec's reason, never raised. With ``keys``, signatures are
checked and the verified signer is reported; a status record the coordinator did
not sign does not count as a saga's status (as in :mod:`coordinator._restore`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from saga.coordinator._admin_dlq import (
    REDRIVEN_BY,
    REDRIVEN_FROM,
    DeadLetter,
    _listed,
    _log_of,
    _text_headers,
    dead_letter,
    dead_letters,
    redrive,
)
from saga.coordinator._reading import read_to
from saga.coordinator._restore import _read, standing_status
from saga.streams import (
    RECORD_TYPES,
    ConfigurationError,
    InvalidRecord,
    SagaState,
    SagaStatus,
    decode_keyed,
    to_dict,
)
from saga.streams._signing import HEADER_KEY_ID, Keyring
from saga.streams.kafka import KafkaSettings, Message, partition_for
from saga.streams.log import Log

__all__ = [
    "REDRIVEN_BY",
    "REDRIVEN_FROM",
    "DeadLetter",
    "HistoryEntry",
    "SagaRow",
    "SagaStep",
    "dead_letter",
    "dead_letters",
    "history",
    "list_sagas",
    "redrive",
    "standing",
    "summarize",
]

_SUMMARY_CHARS = 200


# ---------------------------------------------------------------- history


@dataclass(frozen=True)
class HistoryEntry:
    """One record of a transaction, on any topic.

    ``kind`` is the record's wire type (``saga.request``, ``saga.step``,
    ``saga.committed``, ``saga.decision``, ``saga.status``, ``saga.abort``,
    ``saga.resolve``), or
    ``dlq`` for a dead letter, ``redrive`` for a record an operator copied back
    from the DLQ (header :data:`REDRIVEN_FROM`), ``tombstone`` for a status
    tombstone, ``invalid`` for bytes that do not decode (``summary`` says why).
    ``record`` is the decoded JSON object (for a dead letter: its bytes, if they
    are a JSON object), else ``None``. ``headers`` are decoded as UTF-8 with
    replacement, the signature as hex. ``signer`` is the principal that signed
    the record: verified when keys were given (``"forged: <why>"`` if not valid),
    else as the key id claims it (``"<principal> (unverified)"``); ``None`` when
    unsigned.

    A ``saga.committed`` (a participant's acknowledgement of several committed steps,
    keyed by the first transaction it lists) is one entry, in the history of every
    transaction it lists; its ``summary`` names that transaction's steps as
    ``committed`` at the record's time.
    """

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    kind: str
    summary: str
    record: dict[str, Any] | None
    headers: dict[str, str]
    signer: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this entry."""
        return {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "kind": self.kind,
            "summary": self.summary,
            "signer": self.signer,
            "record": self.record,
            "headers": self.headers,
        }


def history(
    log_or_settings: Log | KafkaSettings,
    tx_id: str,
    *,
    timeout: float = 10.0,
    keys: Keyring | None = None,
) -> list[HistoryEntry]:
    """Every record keyed ``tx_id`` on every topic, ordered by time, then topic, then offset.

    All topics share one partition count and are keyed by ``tx_id``, so only
    partition ``partition_for(tx_id, n)`` of each is read, from its low to its high
    watermark (dead letters keep the original key, so they are found the same way).
    A ``saga.committed`` record lists the steps of several transactions of one
    partition under the first one's key: on the events topic and the DLQ, one that
    lists ``tx_id`` is part of its history too, whatever its key.
    A topic that does not exist (or may not be read) is passed over. Stops after
    ``timeout`` seconds with what was read (an open Kafka transaction holds
    read_committed readers before its records).
    """
    log = _log_of(log_or_settings)
    topics = log.settings.topics
    order = {t: i for i, t in enumerate(topics.all)}
    key = tx_id.encode()
    reader = log.consumer(None, client_id="saga.admin.history")
    found: list[Message] = []
    try:
        partition = partition_for(key, reader.list_partitions(topics.requests, timeout))
        ends: dict[tuple[str, int], int] = {}
        start: list[tuple[str, int, int]] = []
        for topic in topics.all:
            try:
                low, high = reader.watermarks(topic, partition, timeout)
            except ConfigurationError:
                continue  # no such topic (a deployment without a DLQ), or no right to read it
            if high > low:
                ends[(topic, partition)] = high
                start.append((topic, partition, low))
        if start:
            reader.assign(start)
        listing = (topics.events, topics.dlq)  # where a saga.committed may list tx_id

        def lists(m: Message) -> bool:
            return m.topic in listing and _lists(m.value, tx_id)

        found = read_to(reader, ends, timeout, key, lists)
    finally:
        reader.close()
    entries = [_entry(m, topics.dlq, keys, tx_id) for m in found]
    entries.sort(key=lambda e: (e.timestamp_ms or 0, order.get(e.topic, 99), e.offset))
    return entries


def _lists(value: bytes | None, tx_id: str) -> bool:
    """Whether ``value`` looks like a ``saga.committed`` listing ``tx_id``; never raises.

    Loose (the entry decodes it properly, or shows why not), as :func:`_listed` reads it.
    Cheap for the other records of the partition: a value without ``tx_id`` in it (nor
    a JSON escape) is not parsed.
    """
    if value is None or (tx_id.encode() not in value and b"\\u" not in value):
        return False
    return tx_id in _listed(value)


def _signer(m: Message, keys: Keyring | None) -> str | None:
    kid = m.header(HEADER_KEY_ID)
    if kid is None:
        return None
    if keys is None:
        principal = kid.decode("utf-8", "replace").rpartition(".")[0] or "?"
        return f"{principal} (unverified)"
    try:
        return keys.signer(m.topic, m.key, m.value, m.headers)
    except ValueError as exc:
        return f"forged: {exc}"


def _loose_json(value: bytes | None) -> dict[str, Any] | None:
    """``value`` as a JSON object, if it is one; never raises."""
    if value is None:
        return None
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _cut(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _SUMMARY_CHARS else line[: _SUMMARY_CHARS - 3] + "..."


def _entry(
    m: Message, dlq_topic: str, keys: Keyring | None, tx_id: str | None = None
) -> HistoryEntry:
    headers = _text_headers(m.headers)
    signer = _signer(m, keys)

    def made(kind: str, summary: str, record: dict[str, Any] | None) -> HistoryEntry:
        return HistoryEntry(
            topic=m.topic,
            partition=m.partition,
            offset=m.offset,
            timestamp_ms=m.timestamp_ms,
            kind=kind,
            summary=_cut(summary),
            record=record,
            headers=headers,
            signer=signer,
        )

    if m.topic == dlq_topic:
        return made("dlq", _dead_letter_summary(headers), _loose_json(m.value))
    if m.value is None:
        return made("tombstone", "the coordinator forgot this saga (retention)", None)
    record: dict[str, Any] | None
    try:
        decoded = to_dict(decode_keyed(m.key, m.value, *RECORD_TYPES.values()))
        record, kind, summary = decoded, str(decoded.get("type")), summarize(decoded, tx_id)
    except InvalidRecord as exc:
        record = _loose_json(m.value)
        kind, summary = "invalid", f"does not decode: {exc.reason}"
    redriven = headers.get(REDRIVEN_FROM)
    if redriven is not None:
        # An operator's copy from the DLQ shows as such, whether it decodes now or not.
        by = headers.get(REDRIVEN_BY, "?")
        return made("redrive", f"redriven from dlq {redriven} by {by}: {summary}", record)
    return made(kind, summary, record)


def _dead_letter_summary(headers: dict[str, str]) -> str:
    source = (
        f"{headers.get('saga.source.topic', '?')}/{headers.get('saga.source.partition', '?')}"
        f"@{headers.get('saga.source.offset', '?')}"
    )
    return (
        f"rejected by {headers.get('saga.component', '?')} from {source}: "
        f"{headers.get('saga.error', '?')}"
    )


def summarize(record: dict[str, Any], tx_id: str | None = None) -> str:
    """One line about a decoded record (a :func:`streams.to_dict` of it).

    A ``saga.committed`` lists the steps of several transactions: with ``tx_id``
    (a history's transaction), the line is about that one's steps.
    """
    kind = record.get("type")
    if kind == "saga.committed":
        return _summarize_committed(record, tx_id)
    if kind == "saga.request":
        steps = ", ".join(
            f"{i}:{s.get('participant')}.{s.get('action')}"
            for i, s in enumerate(record.get("steps", ()))
        )
        return f"{record.get('saga')} ({record.get('mode')}): {steps}"
    if kind == "saga.step":
        why = f": {record['reason']}" if record.get("reason") else ""
        return f"step {record.get('step')} {record.get('participant')} {record.get('status')}{why}"
    if kind == "saga.decision":
        return f"{record.get('outcome')}: {record.get('reason')}"
    if kind == "saga.status":
        steps = " ".join(f"{s.get('participant')}:{s.get('status')}" for s in record["steps"])
        why = f" ({record['reason']})" if record.get("reason") else ""
        return f"{record.get('state')} [{steps}]{why}"
    if kind == "saga.abort":
        return f"abort: {record.get('reason') or 'no reason given'}"
    if kind == "saga.resolve":
        return f"step {record.get('step')} resolved by hand by {record.get('by')}: " + str(
            record.get("note")
        )
    return str(kind)


def _summarize_committed(record: dict[str, Any], tx_id: str | None) -> str:
    steps = [(str(s[0]), s[1]) for s in record.get("steps", ()) if len(s) == 2]
    participant = record.get("participant")
    mine = [step for tx, step in steps if tx == tx_id]
    if not mine:
        listed = ", ".join(f"{tx}:{step}" for tx, step in steps)
        return f"{participant} committed {_steps(len(steps))}: {listed}"
    which = "step" if len(mine) == 1 else "steps"
    line = f"{which} {', '.join(map(str, mine))} {participant} committed"
    others = len(steps) - len(mine)
    more = f"{others} more step" if others == 1 else f"{others} more steps"
    return line if not others else f"{line} (one record with {more})"


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


# ---------------------------------------------------------------- sagas by state


@dataclass(frozen=True)
class SagaStep:
    """One step of a listed saga: its index, participant and progress."""

    index: int
    participant: str
    status: str


@dataclass(frozen=True)
class SagaRow:
    """A saga as its latest standing status record says (see :func:`list_sagas`)."""

    tx_id: str
    saga: str
    state: str
    reason: str | None
    created_ms: int
    updated_ms: int
    deadline_ms: int
    steps: tuple[SagaStep, ...]

    @classmethod
    def of(cls, status: SagaStatus) -> SagaRow:
        return cls(
            tx_id=status.tx_id,
            saga=status.saga,
            state=status.state.value,
            reason=status.reason,
            created_ms=status.created_ms,
            updated_ms=status.updated_ms,
            deadline_ms=status.deadline_ms,
            steps=tuple(
                SagaStep(i, s.participant, s.status.value) for i, s in enumerate(status.steps)
            ),
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this row."""
        return {
            "tx_id": self.tx_id,
            "saga": self.saga,
            "state": self.state,
            "reason": self.reason,
            "created_ms": self.created_ms,
            "updated_ms": self.updated_ms,
            "deadline_ms": self.deadline_ms,
            "steps": [
                {"step": s.index, "participant": s.participant, "status": s.status}
                for s in self.steps
            ],
        }


def _states(states: Iterable[str | SagaState] | None) -> frozenset[str] | None:
    if states is None:
        return None
    wanted = frozenset(str(s) for s in states)
    unknown = wanted - {s.value for s in SagaState}
    if unknown:
        raise ConfigurationError(
            f"unknown saga state(s) {', '.join(sorted(unknown))}; use "
            + ", ".join(s.value for s in SagaState)
        )
    return wanted


def list_sagas(
    log_or_settings: Log | KafkaSettings,
    *,
    states: Iterable[str | SagaState] | None = None,
    older_than_ms: int | None = None,
    saga: str | None = None,
    participant: str | None = None,
    limit: int | None = None,
    keys: Keyring | None = None,
    now_ms: int | None = None,
) -> list[SagaRow]:
    """The sagas of the status topic, newest update first, filtered.

    Reads the whole compacted status topic; per transaction the standing status
    counts (:func:`coordinator._restore.standing_status`: newest first, undecodable
    records and, with ``keys``, records the coordinator did not sign passed over; a
    tombstone means forgotten). Filters: ``states`` (any of), ``older_than_ms``
    (created at least that long before ``now_ms``, default now: finds stuck sagas),
    ``saga`` (the saga name), ``participant`` (one of its steps names it);
    ``limit`` keeps the first rows. Raises :class:`ConfigurationError` for an
    unknown state name.
    """
    wanted = _states(states)
    log = _log_of(log_or_settings)
    topic = log.settings.topics.status
    probe = log.consumer(None, client_id="saga.admin.list")
    try:
        count = probe.list_partitions(topic)
    finally:
        probe.close()
    cutoff = None
    if older_than_ms is not None:
        cutoff = (now_ms if now_ms is not None else int(time.time() * 1000)) - older_than_ms
    rows: list[SagaRow] = []
    for by_key in _read(log, topic, list(range(count)), "saga.admin.list").values():
        for records in by_key.values():
            _, status = standing_status(records, keys, lambda _m, _why: None)
            if status is None:
                continue
            if wanted is not None and status.state.value not in wanted:
                continue
            if cutoff is not None and status.created_ms > cutoff:
                continue
            if saga is not None and status.saga != saga:
                continue
            if participant is not None and all(s.participant != participant for s in status.steps):
                continue
            rows.append(SagaRow.of(status))
    rows.sort(key=lambda r: (r.updated_ms, r.tx_id), reverse=True)
    return rows if limit is None else rows[:limit]


def standing(
    log_or_settings: Log | KafkaSettings,
    tx_id: str,
    *,
    keys: Keyring | None = None,
    timeout: float = 10.0,
) -> SagaStatus | None:
    """The standing status of one transaction (``None``: none, or forgotten)."""
    log = _log_of(log_or_settings)
    topic = log.settings.topics.status
    key = tx_id.encode()
    reader = log.consumer(None, client_id="saga.admin.status")
    try:
        partition = partition_for(key, reader.list_partitions(topic, timeout))
        low, high = reader.watermarks(topic, partition, timeout)
        if high <= low:
            return None
        reader.assign([(topic, partition, low)])
        records = read_to(reader, {(topic, partition): high}, timeout, key)
    finally:
        reader.close()
    return standing_status(records, keys, lambda _m, _why: None)[1]
