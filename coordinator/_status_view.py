"""The status view: one background reader of the status topic for a whole client.

:class:`StatusView` remembers the transactions its client sent (:meth:`StatusView.follow`)
and those it is asked about, not the whole status topic: a client that runs for a week
beside millions of sagas holds a bounded number of them. Its reader starts at the end of
the status topic (and of the DLQ, for this client's rejected requests) and believes, as
they come, the records of the transactions it follows, waking whoever waits for one.
A transaction asked about for the first time is looked up in the topic on demand: its
partition is read up to where the reader stands (a read that takes longer as the topic
grows: a few seconds per million records), and it is followed from then on.

A transaction sent by the client needs no such read: the coordinator answers every
request it reads with a status record, a repeated one too (or a dead letter), so what
the reader sees from the send on is all there is to know.

With keys it believes a record only when the coordinator signed it: a record that does
not decode or was forged is passed over (logged), and the latest one that stands wins,
as a reader looking newest first would find. Used by :class:`~coordinator.SagaClient`
and :class:`~coordinator.AsyncSagaClient`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Final, TypeVar

from saga.coordinator._reading import read_ahead_capped, read_range
from saga.coordinator._restore import standing_record, standing_status
from saga.streams import (
    ConfigurationError,
    ConflictingRequest,
    InvalidRecord,
    SagaRequest,
    SagaStatus,
    decode_as,
    decode_keyed,
)
from saga.streams._signing import COORDINATOR, Keyring
from saga.streams.kafka import KafkaLog, KafkaSettings, Message, partition_for
from saga.streams.log import Log

log = logging.getLogger("saga.client")

_COORDINATOR_ONLY = frozenset({COORDINATOR})
_CANDIDATES_KEPT = 64
"""How many dead letters a view keeps per transaction (the latest)."""
FOLLOWED_KEPT: Final = 100_000
"""How many transactions a view follows (the latest sent or asked about): about 200 bytes
each. One it stopped following is looked up in the topic again when asked about."""
STATUSES_KEPT: Final = 10_000
"""How many statuses a view keeps decoded (the latest; others are read again by offset)."""
_READ_ON_DEMAND_S: Final = 120.0
"""How long a look-up in the status topic may take before it fails (TransientError)."""

_READER_QUEUE_KIB: Final = 4096
"""What a view's Kafka consumers fetch ahead (:func:`~coordinator._reading.read_ahead_capped`):
the reader keeps few of the records it reads."""

_V = TypeVar("_V")

_NONE: Final = -1
"""A followed transaction with no standing record (none yet, or none since it was sent)."""


class StatusView:
    """Follows the transactions its client sends or asks about (see the module docstring).

    ``from_beginning`` (default): a transaction asked about is looked up in the whole
    (compacted) topic, so :meth:`get` knows transactions submitted by anyone before the
    view started; otherwise only what is published from the view's start on is seen.

    With ``keys``, only status records, tombstones and dead letters the coordinator
    signed are believed; a forged one is logged and passed over. ``log`` makes the
    consumers (default: a :class:`~streams.kafka.KafkaLog` of ``settings``). Making a
    view asks Kafka for the topics' partitions and ends, each question for up to
    ``timeout`` seconds (:class:`~streams.TransientError` when it gets no answer).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        from_beginning: bool = True,
        keys: Keyring | None = None,
        log: Log | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._settings = settings
        self._keys = keys
        self._topic = settings.topics.status
        source = log if log is not None else KafkaLog(settings)
        self._source: Log = read_ahead_capped(source, _READER_QUEUE_KIB)
        self._from_beginning = from_beginning
        self._timeout = timeout
        # Followed transactions -> offset of their standing record (or _NONE), latest last;
        # and the statuses of some of them, decoded (None: a tombstone stands).
        self._known: OrderedDict[str, int] = OrderedDict()
        self._statuses: OrderedDict[str, SagaStatus | bytes | None] = OrderedDict()
        self._pinned: Counter[str] = Counter()  # waited on or being looked up: kept
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._listeners: list[
            tuple[Callable[[SagaStatus], None], Callable[[str], bool] | None]
        ] = []
        self._rejection_listeners: list[Callable[[str], None]] = []
        self._consumer = self._source.consumer(None, client_id="saga.client.status")
        # Requests the coordinator rejected (dead letters from now on), by tx_id: a
        # conflicting or expired request is answered by nothing on the status topic.
        self._dlq = settings.topics.dlq
        self._requests = settings.topics.requests
        self._rejected: OrderedDict[str, list[tuple[str, bytes | None, Message]]] = OrderedDict()
        # Per status partition: where a look-up starts, and the offset after the last record
        # the reader handled (a transaction followed from now has its later records read).
        self._origin: dict[int, int] = {}
        self._done: dict[int, int] = {}
        try:
            self._consumer.assign(self._start(timeout))
        except BaseException:
            self._consumer.close()
            raise
        self._thread = threading.Thread(target=self._run, name="saga-status", daemon=True)
        self._thread.start()

    def _start(self, timeout: float) -> list[tuple[str, int, int]]:
        """Where to read from: the ends of the status topic and of the DLQ."""
        start: list[tuple[str, int, int]] = []
        for p in range(self._consumer.list_partitions(self._topic, timeout)):
            low, high = self._consumer.watermarks(self._topic, p, timeout)
            self._origin[p] = low if self._from_beginning else high
            self._done[p] = high
            start.append((self._topic, p, high))
        try:
            for p in range(self._consumer.list_partitions(self._dlq, timeout)):
                start.append((self._dlq, p, self._consumer.watermarks(self._dlq, p, timeout)[1]))
        except ConfigurationError as exc:  # no DLQ topic, or not allowed to read it
            logging.getLogger("saga.client").info(
                "not following rejected requests (%s): result() waits instead", exc
            )
        return start

    # ------------------------------------------------------------ the reader thread

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._consumer.poll_batch(2000, 0.1)
                if batch:
                    with self._cond:
                        self._take(batch)
                        self._cond.notify_all()
        except BaseException as exc:  # surfaced to callers; the thread must not die silently
            self._error = exc
            with self._cond:
                self._cond.notify_all()
        finally:
            self._consumer.close()

    def _take(self, batch: list[Message]) -> None:
        """Believe what ``batch`` says of the followed transactions; with the lock held."""
        for m in batch:
            if m.topic == self._dlq:
                self._note_rejection(m)
                continue
            self._done[m.partition] = m.offset + 1
            if m.key is None:
                continue
            tx_id = m.key.decode("utf-8", "replace")
            wanted = [f for f, wants in self._listeners if wants is None or wants(tx_id)]
            if tx_id not in self._known and not wanted:
                continue  # not followed: not even decoded
            if not wanted and tx_id not in self._pinned:
                # Nobody waits for it: checked (with keys), kept as read, decoded when asked.
                if self._keys is not None and self._keys.check(
                    m.topic, m.key, m.value, m.headers, _COORDINATOR_ONLY
                ):
                    _forged_note(tx_id)(m, "not signed by the coordinator")
                    continue
                self._set(tx_id, m.offset, m.value)
                continue
            found, status = standing_status([m], self._keys, _forged_note(tx_id))
            if not found:
                continue  # does not decode, or forged: what stood before still stands
            if tx_id in self._known:
                self._set(tx_id, m.offset, status)
            if status is not None:
                for listener in wanted:
                    listener(status)

    def _set(self, tx_id: str, offset: int, status: SagaStatus | bytes | None) -> None:
        """Note the standing record of a followed transaction; with the lock held."""
        self._known[tx_id] = offset
        self._known.move_to_end(tx_id)
        self._statuses[tx_id] = status
        self._statuses.move_to_end(tx_id)
        _trim(self._statuses, STATUSES_KEPT, self._pinned)
        for gone in _trim(self._known, FOLLOWED_KEPT, self._pinned):
            self._statuses.pop(gone, None)

    # ------------------------------------------------------------ following and looking up

    def follow(self, tx_id: str) -> SagaStatus | None:
        """Follow ``tx_id`` from now on: its request is about to be sent, and the coordinator
        answers it with a status record (or a dead letter). Returns its status if the view
        holds it already (nothing is read)."""
        with self._cond:
            status = self._held(tx_id)[1] if tx_id in self._known else None
            if tx_id in self._known:
                self._known.move_to_end(tx_id)
                return status
            self._known[tx_id] = _NONE
            for gone in _trim(self._known, FOLLOWED_KEPT, self._pinned):
                self._statuses.pop(gone, None)
            return None

    def _lookup(self, tx_id: str) -> SagaStatus | None:
        """The standing status of ``tx_id``: held, read again by offset, or looked up in
        the topic (then followed). Called without the lock: reads take time."""
        with self._cond:
            held, status = self._held(tx_id)
            if held or not self._done:
                if tx_id in self._known:
                    self._known.move_to_end(tx_id)
                return status
            p = partition_for(tx_id.encode(), len(self._done))
            offset = self._known.get(tx_id)
            span: tuple[int, int | None]
            if offset is not None:  # known, no longer decoded: that one record again
                span = (offset, offset + 1)
            else:  # not followed: its partition, to its end now (the reader takes the rest)
                span = (self._origin[p], None)
                self._known[tx_id] = _NONE
            self._pinned[tx_id] += 1
        try:
            records, upto = read_range(
                self._source,
                self._topic,
                {p: span},
                timeout=max(self._timeout, _READ_ON_DEMAND_S),
                client_id="saga.client.lookup",
                key=tx_id.encode(),
            )
            stood = standing_record(records, self._keys, _forged_note(tx_id))
            with self._cond:
                if self._known.get(tx_id, _NONE) >= upto[p]:
                    return self._held(tx_id)[1]  # the reader took a newer record meanwhile
                if stood is None:  # none stands (or it is gone: forgotten long ago)
                    self._known[tx_id] = _NONE
                    self._statuses.pop(tx_id, None)
                    return None
                self._set(tx_id, stood[0].offset, stood[1])
                return stood[1]
        finally:
            with self._cond:
                self._unpin(tx_id)

    def _unpin(self, tx_id: str) -> None:
        self._pinned[tx_id] -= 1
        if self._pinned[tx_id] <= 0:
            del self._pinned[tx_id]

    def _held(self, tx_id: str) -> tuple[bool, SagaStatus | None]:
        """What the view holds of ``tx_id`` without reading; with the lock held."""
        if tx_id not in self._statuses:
            return self._known.get(tx_id) == _NONE, None
        held = self._statuses[tx_id]
        if not isinstance(held, bytes):
            return True, held
        try:  # kept as read: decoded now that it is asked about
            status = decode_keyed(tx_id.encode(), held, SagaStatus)
        except InvalidRecord:  # not a status (anyone may write without keys): look it up
            del self._statuses[tx_id]
            del self._known[tx_id]
            return False, None
        assert isinstance(status, SagaStatus)
        self._statuses[tx_id] = status
        return True, status

    # ------------------------------------------------------------ rejections

    def _note_rejection(self, m: Message) -> None:
        if m.header("saga.source.topic") != self._requests.encode() or m.key is None:
            return
        reason = (m.header("saga.error") or b"rejected").decode("utf-8", "replace")
        tx_id = m.key.decode("utf-8", "replace")
        kept = self._rejected.setdefault(tx_id, [])
        if self._keys is None:
            kept.clear()  # believed as it is: the latest wins
        kept.append((reason, m.value, m))
        if len(kept) > _CANDIDATES_KEPT:
            del kept[0]
        self._rejected.move_to_end(tx_id)
        while len(self._rejected) > _REJECTIONS_KEPT:
            self._rejected.popitem(last=False)
        for listener in self._rejection_listeners:
            listener(tx_id)

    def _raise_if_rejected(self, tx_id: str, fingerprint: str) -> None:
        """Raise for a believed dead letter of the request ``fingerprint``; lock held."""
        kept = self._rejected.get(tx_id)
        if not kept:
            return
        for entry in reversed(list(kept)):
            reason, value, m = entry
            if not _is_ours(fingerprint, value):
                continue
            if self._keys is not None:
                why = self._keys.check(m.topic, m.key, m.value, m.headers, _COORDINATOR_ONLY)
                if why is not None:
                    log.warning(
                        "not believing the dead letter of %s at %s/%d@%d: %s",
                        tx_id,
                        m.topic,
                        m.partition,
                        m.offset,
                        why,
                    )
                    kept.remove(entry)
                    continue
            _raise_rejected(tx_id, reason)

    # ------------------------------------------------------------ the API

    def wait_caught_up(self, timeout: float) -> bool:
        """True: the view reads history on demand (:meth:`get`), it has nothing to catch up."""
        if self._error is not None:
            raise self._error
        return True

    def listen(
        self,
        listener: Callable[[SagaStatus], None],
        wants: Callable[[str], bool] | None = None,
    ) -> None:
        """Call ``listener`` (in the reader thread, quickly) with every new status.

        ``wants(tx_id)``, when given, says which transactions the listener cares
        about: only their records are decoded (and, with keys, verified) for it.
        """
        with self._cond:
            self._listeners.append((listener, wants))

    def listen_rejections(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(tx_id)`` (in the reader thread) when a request is dead-lettered."""
        with self._cond:
            self._rejection_listeners.append(listener)

    def check_rejected(self, tx_id: str, fingerprint: str | None) -> None:
        """Raise as :meth:`wait_final` does if the request with ``fingerprint`` was rejected."""
        if fingerprint is None:
            return
        with self._cond:
            self._raise_if_rejected(tx_id, fingerprint)

    def get(self, tx_id: str) -> SagaStatus | None:
        """The latest standing status of ``tx_id`` (``None``: none, or forgotten). One the
        view does not follow yet is looked up in the topic (see the module docstring)."""
        if self._error is not None:
            raise self._error
        return self._lookup(tx_id)

    def snapshot(self) -> dict[str, SagaStatus]:
        """Every transaction's latest standing status: the whole topic, read now (its size
        in memory, and its time: for a look at everything, not for a loop)."""
        ranges: dict[int, tuple[int, int | None]] = {p: (o, None) for p, o in self._origin.items()}
        records, _ = read_range(
            self._source,
            self._topic,
            ranges,
            timeout=max(self._timeout, _READ_ON_DEMAND_S),
            client_id="saga.client.snapshot",
        )
        by_key: dict[bytes, list[Message]] = {}
        for m in records:
            if m.key is not None:
                by_key.setdefault(m.key, []).append(m)
        found: dict[str, SagaStatus] = {}
        for key, kept in by_key.items():
            tx_id = key.decode("utf-8", "replace")
            _, status = standing_status(kept, self._keys, _forged_note(tx_id))
            if status is not None:
                found[tx_id] = status
        return found

    def wait_final(
        self, tx_id: str, timeout: float, fingerprint: str | None = None
    ) -> SagaStatus | None:
        """The final status of ``tx_id``, or ``None`` if it is not final within ``timeout``.

        With ``fingerprint`` (of the request this process sent), a dead letter of that
        very request ends the wait at once: :class:`ConflictingRequest` when the
        transaction id was already used for another payload, :class:`InvalidRecord`
        with the coordinator's reason otherwise.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            self._pinned[tx_id] += 1  # followed, and its status kept, while waited on
        try:
            status = self.get(tx_id)
            with self._cond:
                while True:
                    if self._error is not None:
                        raise self._error
                    held, status = self._held(tx_id)
                    if not held:
                        break  # no longer decoded (cannot be while pinned): read below
                    if status is not None and status.state.final:
                        return status
                    if fingerprint is not None:
                        self._raise_if_rejected(tx_id, fingerprint)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
            status = self.get(tx_id)
            return status if status is not None and status.state.final else None
        finally:
            with self._cond:
                self._unpin(tx_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


_REJECTIONS_KEPT = 10_000
"""How many rejected requests a status view remembers (the latest)."""


def _trim(kept: OrderedDict[str, _V], limit: int, pinned: Counter[str]) -> list[str]:
    """Drop the oldest entries of ``kept`` beyond ``limit`` (never a pinned one); returns
    the keys dropped."""
    dropped: list[str] = []
    for _ in range(len(kept) - limit):
        tx_id, value = kept.popitem(last=False)
        if tx_id in pinned:
            kept[tx_id] = value  # waited on: kept, at the young end
        else:
            dropped.append(tx_id)
    return dropped


def _forged_note(tx_id: str) -> Callable[[Message, str], None]:
    def forged(m: Message, reason: str) -> None:
        log.warning(
            "not believing the status record of %s at %s/%d@%d: %s",
            tx_id,
            m.topic,
            m.partition,
            m.offset,
            reason,
        )

    return forged


def _is_ours(fingerprint: str, value: bytes | None) -> bool:
    """Whether a dead letter's ``value`` is the request with ``fingerprint``."""
    try:
        rejected = decode_as(value, SagaRequest)
    except InvalidRecord:
        return False
    return isinstance(rejected, SagaRequest) and rejected.fingerprint() == fingerprint


def _raise_rejected(tx_id: str, reason: str) -> None:
    """Raise for the coordinator's dead letter of this client's request."""
    if "different payload" in reason:
        raise ConflictingRequest(
            f"transaction {tx_id} was already submitted with a different payload, so the "
            "coordinator rejected this request: use a new tx_id for a different transaction"
        )
    raise InvalidRecord(f"the coordinator rejected transaction {tx_id}'s request: {reason}")
