"""The run's view of the log: what it sends, what it follows live, and a full read at the end.

* :class:`Sender` produces everything the run writes itself (requests, aborts,
  duplicates, poison) through one idempotent producer and records each record's
  fate from its delivery report: acknowledged (with partition and offset) or not.
* :class:`DecisionTail` follows ``<prefix>.decisions`` (``read_committed``) from the
  start: the original bytes and position of each transaction's first decision
  (the duplicates and the barrier trio need them).
* :func:`read_log` reads requests, events, decisions, the DLQ and the status topic
  to their end, for the checker. On the events topic a ``saga.committed`` record
  counts as the ``committed`` event of each step it lists (:func:`take_event`).

Signed records (the suite's default, :mod:`streams._signing`): the sender signs
what the run writes as the ``client`` (a duplicate goes out as the original
record, its original headers and signature included, plus the unsigned
annotation :data:`INJECTED_HEADER`: a replayed signed record is valid); poison
goes out unsigned or forged. The tails and :func:`read_log` take only records
signed by a principal allowed to write them, as every consumer does.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from saga.streams import (
    Decision,
    InvalidRecord,
    SagaAbort,
    SagaRequest,
    SagaStatus,
    StepEvent,
    StepsCommitted,
    decode_as,
    step_events,
)
from saga.streams._errors import SagaError
from saga.streams._signing import COORDINATOR, UNSIGNED_HEADER_PREFIX, Keyring, allowed_signers
from saga.streams.kafka import Consumer, KafkaSettings, Message, Producer, partition_for

INJECTED_HEADER = f"{UNSIGNED_HEADER_PREFIX}chaos"
"""Header on the records the run repeats on purpose (value ``duplicate``); under
``saga.replayed.``, outside the signature, so a repeated signed record stays valid."""
REPLAYED_HEADER = "saga.replayed.by"
"""Header the reconciliation job puts on the records it re-publishes."""


@dataclass
class Delivery:
    """One record the run produced, and what Kafka said about it."""

    topic: str
    key: bytes | None
    value: bytes | None
    label: str
    acked: bool | None = None  # None: no report yet; False: not delivered
    partition: int = -1
    offset: int = -1
    error: str | None = None
    headers: tuple[tuple[str, bytes], ...] = ()  # as sent


class Sender:
    """One producer for the run's own records; every delivery report is kept.

    ``keys`` (the ``client``'s keyring): records are signed unless sent with
    ``sign=False`` or with the exact ``headers`` to send (a duplicate's original ones).
    """

    def __init__(self, settings: KafkaSettings, keys: Keyring | None = None) -> None:
        self.settings = settings
        self.keys = keys
        self.topics = settings.topics
        # Poison includes records near 1 MB, over the producer's default limit.
        roomy = KafkaSettings(
            bootstrap=settings.bootstrap,
            prefix=settings.prefix,
            extra={**settings.extra, "message.max.bytes": "2000000"},
        )
        self._producer = Producer(roomy, client_id="chaos.runner")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="sender-poll", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self._producer.poll(0.1)
            except SagaError:
                time.sleep(0.1)

    def send(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        *,
        label: str,
        injected: str | None = None,
        on_done: Callable[[Delivery], None] | None = None,
        partition: int | None = None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        sign: bool = True,
    ) -> Delivery:
        keyed = key.encode() if isinstance(key, str) else key
        if headers is not None:
            own = list(headers)
        elif sign and self.keys is not None:
            own = self.keys.sign(topic, key, value)
        else:
            own = []
        record = Delivery(topic, keyed, value, label, headers=tuple(own))

        def delivered(error: object, message: Message) -> None:
            with self._lock:
                if error is None:
                    record.acked = True
                    record.partition, record.offset = message.partition, message.offset
                else:
                    record.acked = False
                    record.error = str(error)
            if on_done is not None:
                on_done(record)

        if injected:
            own.append((INJECTED_HEADER, injected.encode()))
        self._producer.produce(
            topic, key, value, headers=own or None, on_delivery=delivered, partition=partition
        )
        return record

    def flush(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._producer.flush(min(5.0, max(0.1, deadline - time.monotonic())))
                return
            except SagaError:
                continue

    def close(self) -> None:
        if self._stop.is_set():
            return
        self.flush(60)
        self._stop.set()
        self._poller.join(5)
        self._producer.close()


@dataclass
class DecisionSeen:
    tx_id: str
    outcome: str
    value: bytes
    partition: int
    offset: int
    headers: tuple[tuple[str, bytes], ...] = ()


def authentic(keys: Keyring | None, m: Message, allowed: frozenset[str]) -> bool:
    """Whether ``m`` carries a valid signature of one of ``allowed`` (always, without keys)."""
    return keys is None or keys.check(m.topic, m.key, m.value, m.headers, allowed) is None


_BY_COORDINATOR = frozenset({COORDINATOR})


class DecisionTail:
    """Follows the decisions topic from its start; keeps each transaction's first decision
    (with ``keys``: the first the coordinator signed)."""

    def __init__(
        self, settings: KafkaSettings, partitions: int, keys: Keyring | None = None
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.partitions = partitions
        self.first: dict[str, DecisionSeen] = {}
        self.listeners: list[Callable[[DecisionSeen], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decision-tail", daemon=True)

    def start(self) -> DecisionTail:
        self._thread.start()
        return self

    def _run(self) -> None:
        topic = self.settings.topics.decisions
        consumer = Consumer(self.settings, group_id=None, client_id="chaos.decisions")
        try:
            consumer.assign([(topic, p, 0) for p in range(self.partitions)])
            while not self._stop.is_set():
                try:
                    batch = consumer.poll_batch(500, 0.2)
                except SagaError:
                    time.sleep(0.5)
                    continue
                for m in batch:
                    self._take(m)
        finally:
            consumer.close()

    def _take(self, m: Message) -> None:
        if m.header(INJECTED_HEADER) is not None or m.header(REPLAYED_HEADER) is not None:
            return
        try:
            record = decode_as(m.value, Decision)
        except InvalidRecord:
            return
        assert isinstance(record, Decision)
        if m.key is None or m.key.decode(errors="replace") != record.tx_id:
            return
        if not authentic(self.keys, m, _BY_COORDINATOR):
            return  # forged: no decision
        assert m.value is not None
        seen = DecisionSeen(
            record.tx_id, str(record.outcome), m.value, m.partition, m.offset, m.headers
        )
        with self._lock:
            if record.tx_id in self.first:
                return
            self.first[record.tx_id] = seen
            listeners = list(self.listeners)
        for listener in listeners:
            listener(seen)

    def get(self, tx_id: str) -> DecisionSeen | None:
        with self._lock:
            return self.first.get(tx_id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


class StatusTail:
    """Follows the status topic from its start: each transaction's latest state, and when
    it was first seen final (``time.monotonic()``); with ``keys``, only the records the
    coordinator signed."""

    def __init__(
        self, settings: KafkaSettings, partitions: int, keys: Keyring | None = None
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.partitions = partitions
        self.state: dict[str, str] = {}
        self.final_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="status-tail", daemon=True)

    def start(self) -> StatusTail:
        self._thread.start()
        return self

    def _run(self) -> None:
        topic = self.settings.topics.status
        consumer = Consumer(self.settings, group_id=None, client_id="chaos.status")
        try:
            consumer.assign([(topic, p, 0) for p in range(self.partitions)])
            while not self._stop.is_set():
                try:
                    batch = consumer.poll_batch(2000, 0.2)
                except SagaError:
                    time.sleep(0.5)
                    continue
                now = time.monotonic()
                with self._lock:
                    for m in batch:
                        try:
                            status = decode_as(m.value, SagaStatus)
                        except InvalidRecord:
                            continue
                        assert isinstance(status, SagaStatus)
                        if not authentic(self.keys, m, _BY_COORDINATOR):
                            continue  # forged
                        self.state[status.tx_id] = str(status.state)
                        if status.state.final:
                            self.final_at.setdefault(status.tx_id, now)
        finally:
            consumer.close()

    def finals(self) -> dict[str, float]:
        with self._lock:
            return dict(self.final_at)

    def final_count(self) -> int:
        with self._lock:
            return len(self.final_at)

    def states(self) -> dict[str, str]:
        with self._lock:
            return dict(self.state)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# ---------------------------------------------------------------- reading it all


def read_messages(
    settings: KafkaSettings, topic: str, *, timeout: float = 300
) -> Iterator[Message]:
    """Every record of ``topic`` (``read_committed``) up to its end as of now."""
    consumer = Consumer(settings, group_id=None, client_id="chaos.reader")
    try:
        ends: dict[int, int] = {}
        for p in range(consumer.list_partitions(topic)):
            low, high = consumer.watermarks(topic, p)
            if high > low:
                ends[p] = high
        if not ends:
            return
        consumer.assign([(topic, p, 0) for p in ends])
        deadline = time.monotonic() + timeout
        while ends:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} did not reach its end within {timeout:g}s")
            for m in consumer.poll_batch(5000, 0.2):
                if m.partition in ends:
                    yield m
                    if m.offset + 1 >= ends[m.partition]:
                        ends.pop(m.partition, None)
            # Transaction markers take offsets too: the position says when a partition is done.
            if ends:
                positions = consumer.position([(topic, p) for p in ends])
                for (_, p), pos in positions.items():
                    if pos is not None and pos >= ends.get(p, 0):
                        ends.pop(p, None)
    finally:
        consumer.close()


@dataclass(frozen=True)
class DecisionRecord:
    outcome: str
    replayed: bool
    injected: bool
    value: bytes


@dataclass(frozen=True)
class DeadLetter:
    source: tuple[str, int, int]
    key: bytes | None
    value: bytes | None
    error: str


@dataclass
class LogView:
    """What the log holds, per transaction (valid records only) and in the DLQ."""

    requests: dict[str, SagaRequest] = field(default_factory=dict)
    aborts: set[str] = field(default_factory=set)
    decisions: dict[str, list[DecisionRecord]] = field(default_factory=lambda: defaultdict(list))
    events: dict[tuple[str, int], set[str]] = field(default_factory=lambda: defaultdict(set))
    confirms: set[tuple[str, int]] = field(default_factory=set)
    """Steps whose ``applied`` event said ``confirm``: only they report ``committed``."""
    dlq: list[DeadLetter] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    """Keys of records on the requests topic that were not taken, and why (a lost saga's
    report says whether its record is there at all)."""
    statuses: dict[str, SagaStatus] = field(default_factory=dict)
    records: dict[str, int] = field(default_factory=dict)
    decided_ms: dict[str, int] = field(default_factory=dict)
    """The Kafka timestamp of each transaction's first coordinator decision (not a replay
    nor a duplicate): no participant acts on the decision before it was produced."""
    decision_reasons: dict[str, str] = field(default_factory=dict)
    event_ms: dict[tuple[str, int, str], int] = field(default_factory=dict)
    """``(tx_id, step, status)`` -> the Kafka timestamp of its first event: produced after
    the participant's local commit, so the step's effect was in its store by then. A step
    acknowledged by a ``saga.committed`` record gets that record's timestamp (not its
    ``at_ms``: the participant takes that when its batch starts, before the commit)."""
    acks: int = 0
    """How many valid ``saga.committed`` records the events topic holds."""

    def drop(self, m: Message, why: str) -> None:
        """Note that the requests-topic record ``m`` was not taken, and why."""
        name = (m.key or b"").decode(errors="replace")
        self.dropped.setdefault(name, f"partition {m.partition} offset {m.offset}: {why}")

    def take_event(self, m: Message, keys: Keyring | None = None, partitions: int = 0) -> bool:
        """Take the events-topic record ``m`` as the coordinator does; whether it was forged.

        A ``saga.step`` is one event, a ``saga.committed`` one ``committed`` event per
        step it lists, each at the record's timestamp. Ignored (as the coordinator moves
        them to the DLQ): an invalid record, one keyed other than its ``tx_id`` (for a
        ``saga.committed``, its first one), one not signed by its participant (with
        ``keys``), and, given the topic's ``partitions``, a ``saga.committed`` listing a
        transaction of another partition than the one it is on.
        """
        try:
            record = decode_as(m.value, StepEvent, StepsCommitted)
        except InvalidRecord:
            return False
        assert isinstance(record, StepEvent | StepsCommitted)
        if not authentic(keys, m, allowed_signers(record)):
            return True
        if not _keyed(m, record.tx_id):
            return False
        if isinstance(record, StepsCommitted):
            if partitions and any(
                partition_for(tx_id, partitions) != m.partition for tx_id, _ in record.steps
            ):
                return False
            self.acks += 1
        for event in step_events(record):
            self.events[(event.tx_id, event.step)].add(str(event.status))
            _earliest(self.event_ms, (event.tx_id, event.step, str(event.status)), m)
            if event.confirm:
                self.confirms.add((event.tx_id, event.step))
        return False

    def missing(self, tx_id: str) -> str:
        """Why an acknowledged request of ``tx_id`` is not in :attr:`requests`."""
        return self.dropped.get(
            tx_id, f"no record keyed {tx_id} (of {self.records.get('requests')})"
        )


def _earliest(into: dict[Any, int], key: Any, m: Message) -> None:
    if m.timestamp_ms is not None and (key not in into or m.timestamp_ms < into[key]):
        into[key] = m.timestamp_ms


def _keyed(m: Message, tx_id: str) -> bool:
    return m.key is not None and m.key.decode(errors="replace") == tx_id


def _partition_count(settings: KafkaSettings, topic: str) -> int:
    consumer = Consumer(settings, group_id=None, client_id="chaos.reader")
    try:
        return consumer.list_partitions(topic)
    finally:
        consumer.close()


def read_log(settings: KafkaSettings, keys: Keyring | None = None) -> LogView:
    """Read the whole log of ``settings.prefix`` as it is now (with ``keys``: only the
    records signed by a principal allowed to write them, as consumers take them)."""
    t = settings.topics
    partitions = _partition_count(settings, t.events)
    view = LogView()
    forged = 0
    n = 0
    for m in read_messages(settings, t.requests):
        n += 1
        try:
            record = decode_as(m.value, SagaRequest, SagaAbort)
        except InvalidRecord as exc:
            view.drop(m, f"not a valid record ({exc})")
            continue
        if not _keyed(m, record.tx_id):
            view.drop(m, f"keyed other than {record.tx_id}")
            continue
        why = None if keys is None else keys.check(m.topic, m.key, m.value, m.headers,
                                                   allowed_signers(record))  # fmt: skip
        if why is not None:
            view.drop(m, why)
            forged += 1
            continue
        if isinstance(record, SagaRequest):
            view.requests.setdefault(record.tx_id, record)
        else:
            view.aborts.add(record.tx_id)
    view.records["requests"] = n
    n = 0
    for m in read_messages(settings, t.events):
        n += 1
        forged += view.take_event(m, keys, partitions)
    view.records["events"] = n
    view.records["events.saga.committed"] = view.acks
    n = 0
    for m in read_messages(settings, t.decisions):
        n += 1
        try:
            decision = decode_as(m.value, Decision)
        except InvalidRecord:
            continue
        assert isinstance(decision, Decision) and m.value is not None
        if not authentic(keys, m, _BY_COORDINATOR):
            forged += 1
            continue
        if _keyed(m, decision.tx_id):
            replayed = m.header(REPLAYED_HEADER) is not None
            injected = m.header(INJECTED_HEADER) is not None
            view.decisions[decision.tx_id].append(
                DecisionRecord(str(decision.outcome), replayed, injected, m.value)
            )
            if not replayed and not injected:
                _earliest(view.decided_ms, decision.tx_id, m)
                view.decision_reasons.setdefault(decision.tx_id, decision.reason)
    view.records["decisions"] = n
    for m in read_messages(settings, t.dlq):
        source = (
            (m.header("saga.source.topic") or b"").decode(errors="replace"),
            int(m.header("saga.source.partition") or b"-1"),
            int(m.header("saga.source.offset") or b"-1"),
        )
        error = (m.header("saga.error") or b"").decode(errors="replace")
        view.dlq.append(DeadLetter(source, m.key, m.value, error))
    view.records["dlq"] = len(view.dlq)
    for m in read_messages(settings, t.status):
        try:
            status = decode_as(m.value, SagaStatus)
        except InvalidRecord:
            continue
        assert isinstance(status, SagaStatus)
        if not authentic(keys, m, _BY_COORDINATOR):
            forged += 1
            continue
        view.statuses[status.tx_id] = status
    view.records["forged"] = forged
    return view
