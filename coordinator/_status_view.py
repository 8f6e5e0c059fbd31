"""The status view: one background reader of the status topic for a whole client.

:class:`StatusView` follows the compacted status topic (and the DLQ, for this
client's rejected requests) from the start, keeps the latest status per
transaction, and wakes whoever waits for one. With keys it believes a record only
when the coordinator signed it, checked lazily: newest first, and only for the
transactions someone asks about or waits for. Used by :class:`~coordinator.SagaClient`
and :class:`~coordinator.AsyncSagaClient`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from saga.coordinator._restore import standing_status
from saga.streams import (
    ConfigurationError,
    ConflictingRequest,
    InvalidRecord,
    SagaRequest,
    SagaStatus,
    decode_as,
)
from saga.streams._signing import COORDINATOR, Keyring
from saga.streams.kafka import KafkaLog, KafkaSettings, Message
from saga.streams.log import Log

log = logging.getLogger("saga.client")

_COORDINATOR_ONLY = frozenset({COORDINATOR})
_CANDIDATES_KEPT = 64
"""How many unverified status records a view keeps per transaction (the latest)."""


class StatusView:
    """Follows the status topic in a background thread; the latest record per transaction.

    ``from_beginning`` reads the whole (compacted) topic first, so ``get`` knows
    transactions submitted by anyone before the view started; otherwise only
    what is published from now on is seen.

    With ``keys``, only status records, tombstones and dead letters the coordinator
    signed are believed: the records of a transaction are kept as read and verified,
    newest first, when the transaction is asked about (:meth:`get`,
    :meth:`wait_final`, :meth:`snapshot`, a listener that wants it); a forged one is
    logged and dropped. ``log`` makes the consumer (default: a
    :class:`~streams.kafka.KafkaLog` of ``settings``). Making a view asks Kafka for
    the topics' partitions and ends, each question for up to ``timeout`` seconds
    (:class:`~streams.TransientError` when it gets no answer).
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
        self._latest: dict[str, SagaStatus] = {}
        # With keys: records read but not verified yet, per tx_id (oldest first), newer
        # than what _latest holds for it.
        self._unverified: dict[str, list[Message]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._error: BaseException | None = None
        self._listeners: list[
            tuple[Callable[[SagaStatus], None], Callable[[str], bool] | None]
        ] = []
        self._rejection_listeners: list[Callable[[str], None]] = []
        source: Log = log if log is not None else KafkaLog(settings)
        self._consumer = source.consumer(None, client_id="saga.client.status")
        # Requests the coordinator rejected (dead letters from now on), by tx_id: a
        # conflicting or expired request is answered by nothing on the status topic.
        self._dlq = settings.topics.dlq
        self._requests = settings.topics.requests
        self._rejected: OrderedDict[str, list[tuple[str, bytes | None, Message]]] = OrderedDict()
        self._ends: dict[int, int] = {}
        try:
            self._consumer.assign(self._start(from_beginning, timeout))
        except BaseException:
            self._consumer.close()
            raise
        if not self._ends:
            self._caught_up.set()
        self._thread = threading.Thread(target=self._run, name="saga-status", daemon=True)
        self._thread.start()

    def _start(self, from_beginning: bool, timeout: float) -> list[tuple[str, int, int]]:
        """Where to read from: the status topic (and its ends, ``from_beginning``), the DLQ."""
        start: list[tuple[str, int, int]] = []
        for p in range(self._consumer.list_partitions(self._topic, timeout)):
            low, high = self._consumer.watermarks(self._topic, p, timeout)
            if from_beginning:
                start.append((self._topic, p, low))
                if high > low:
                    self._ends[p] = high
            else:
                start.append((self._topic, p, high))
        try:
            for p in range(self._consumer.list_partitions(self._dlq, timeout)):
                start.append((self._dlq, p, self._consumer.watermarks(self._dlq, p, timeout)[1]))
        except ConfigurationError as exc:  # no DLQ topic, or not allowed to read it
            logging.getLogger("saga.client").info(
                "not following rejected requests (%s): result() waits instead", exc
            )
        return start

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._consumer.poll_batch(2000, 0.1)
                if batch:
                    with self._cond:
                        if self._keys is None:
                            self._take(batch)
                        else:
                            self._keep(batch)
                        self._cond.notify_all()
                if not self._caught_up.is_set():
                    self._check_caught_up()
        except BaseException as exc:  # surfaced to callers; the thread must not die silently
            self._error = exc
            with self._cond:
                self._cond.notify_all()
        finally:
            self._consumer.close()

    def _take(self, batch: list[Message]) -> None:
        """Believe ``batch`` as it is (no keys); with the lock held."""
        for m in batch:
            if m.topic == self._dlq:
                self._note_rejection(m)
                continue
            if m.value is None:
                # A tombstone: the coordinator forgot the saga (retention).
                if m.key is not None:
                    self._latest.pop(m.key.decode("utf-8", "replace"), None)
                continue
            try:
                status = decode_as(m.value, SagaStatus)
            except InvalidRecord:
                continue
            assert isinstance(status, SagaStatus)
            self._latest[status.tx_id] = status
            for listener, wants in self._listeners:
                if wants is None or wants(status.tx_id):
                    listener(status)

    def _keep(self, batch: list[Message]) -> None:
        """Keep ``batch`` to verify when asked (keys); with the lock held."""
        touched: dict[str, None] = {}
        for m in batch:
            if m.topic == self._dlq:
                self._note_rejection(m)
                continue
            if m.key is None:
                continue
            tx_id = m.key.decode("utf-8", "replace")
            kept = self._unverified.setdefault(tx_id, [])
            kept.append(m)
            if len(kept) > _CANDIDATES_KEPT:
                del kept[0]
            touched[tx_id] = None
        if not self._listeners:
            return
        for tx_id in touched:
            wanted = [f for f, wants in self._listeners if wants is None or wants(tx_id)]
            if wanted and tx_id in self._unverified:
                status = self._resolve(tx_id)
                if status is not None:
                    for listener in wanted:
                        listener(status)

    def _resolve(self, tx_id: str) -> SagaStatus | None:
        """Verify ``tx_id``'s unverified records, newest first; with the lock held."""
        kept = self._unverified.pop(tx_id, None)
        if kept and self._keys is not None:

            def forged(m: Message, reason: str) -> None:
                log.warning(
                    "not believing the status record of %s at %s/%d@%d: %s",
                    tx_id,
                    m.topic,
                    m.partition,
                    m.offset,
                    reason,
                )

            found, status = standing_status(kept, self._keys, forged)
            if found and status is None:  # a tombstone: the coordinator forgot the saga
                self._latest.pop(tx_id, None)
            elif status is not None:
                self._latest[tx_id] = status
        return self._latest.get(tx_id)

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

    def _check_caught_up(self) -> None:
        positions = self._consumer.position([(self._topic, p) for p in self._ends])
        if all(pos is not None and pos >= self._ends[p] for (_, p), pos in positions.items()):
            self._caught_up.set()

    def wait_caught_up(self, timeout: float) -> bool:
        return self._caught_up.wait(timeout)

    def listen(
        self,
        listener: Callable[[SagaStatus], None],
        wants: Callable[[str], bool] | None = None,
    ) -> None:
        """Call ``listener`` (in the reader thread, quickly) with every new status.

        ``wants(tx_id)``, when given, says which transactions the listener cares
        about: with keys, only their records are verified for it.
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
        with self._cond:
            return self._resolve(tx_id)

    def snapshot(self) -> dict[str, SagaStatus]:
        """Every transaction's latest status (with keys, every one is verified now)."""
        with self._cond:
            for tx_id in list(self._unverified):
                self._resolve(tx_id)
            return dict(self._latest)

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
            while True:
                if self._error is not None:
                    raise self._error
                status = self._resolve(tx_id)
                if status is not None and status.state.final:
                    return status
                if fingerprint is not None:
                    self._raise_if_rejected(tx_id, fingerprint)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


_REJECTIONS_KEPT = 10_000
"""How many rejected requests a status view remembers (the latest)."""


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
