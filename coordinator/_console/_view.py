"""The materialised view of the status topic: the stream-table duality, for the console.

:class:`StatusTable` follows ``<prefix>.status`` (compacted, keyed by ``tx_id``) and
``<prefix>.dlq`` in a background thread and keeps a table of the latest standing
status of every transaction in a :class:`~coordinator._console._store.ViewStore`
(SQLite by default, PostgreSQL when configured):

* per batch and transaction, the status that stands is chosen by
  :func:`coordinator._restore.standing_status`, the rule the coordinator's restore
  uses: newest first, a record that does not decode is passed over, and with keys a
  record the coordinator did not sign is reported (logged, counted) and passed over;
  a tombstone deletes the row. When nothing in the batch stands, the row keeps what
  it held;
* dead letters are listed with their headers and an excerpt of their bytes (they are
  hostile by definition: nothing in them is interpreted beyond the headers);
* the offsets after the batch are written in the same database transaction as its
  rows, so a restarted console resumes where it stopped and never applies a batch
  twice or skips one. When the stored offsets do not fit the topics any more (a
  topic made anew, fewer records than the stored offset), the view starts over.

A failure of the database or of Kafka is logged and the follower starts again from
the stored offsets after a pause; :attr:`StatusTable.health` says what is wrong.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence

from saga.coordinator._console._store import DeadLetter, ViewStore
from saga.coordinator._restore import standing_status
from saga.streams import TX_ID_PATTERN, ConfigurationError, SagaStatus
from saga.streams._limits import DLQ_EXCERPT_BYTES
from saga.streams._secrets import redact
from saga.streams._signing import Keyring
from saga.streams.kafka import Message
from saga.streams.log import Log, LogConsumer

log = logging.getLogger("saga.console")

_RETRY_S = 2.0


class StatusTable:
    """Keeps ``store``'s ``sagas`` and ``console_dlq`` tables following the log.

    ``keys`` (public keys suffice) makes it believe only status records the
    coordinator signed. Call :meth:`start` to follow in a thread, or :meth:`step`
    to read one batch in the caller's (for tests).
    """

    def __init__(self, log_: Log, store: ViewStore, *, keys: Keyring | None = None) -> None:
        self._log = log_
        self._store = store
        self._keys = keys
        topics = log_.settings.topics
        self.status_topic = topics.status
        self.dlq_topic = topics.dlq
        self._consumer: LogConsumer | None = None
        self._positions: dict[tuple[str, int], int] = {}
        self._ends: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._thread: threading.Thread | None = None
        self.forged = 0
        """Status records passed over because the coordinator did not sign them."""
        self.health = "starting"
        """``ok``, ``starting``, or what went wrong last (one sentence)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> StatusTable:
        self._thread = threading.Thread(target=self._run, name="saga-console-view", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._close_consumer()

    def wait_caught_up(self, timeout: float) -> bool:
        """Whether the view has read what the topics held when it (re)started."""
        return self._caught_up.wait(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                while not self._stop.is_set():
                    self.step()
            except Exception as exc:  # a bad database or broker moment: start again, resumed
                self.health = redact(f"{type(exc).__name__}: {exc}")
                log.warning("the console's view stopped (%s); starting again", self.health)
                self._close_consumer()
                if self._stop.wait(_RETRY_S):
                    return
                try:
                    self._store.reconnect()
                except Exception as again:
                    self.health = redact(f"{type(again).__name__}: {again}")

    def _close_consumer(self) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close()
            finally:
                self._consumer = None

    # ------------------------------------------------------------------ reading

    def _open(self) -> LogConsumer:
        consumer = self._log.consumer(None, client_id="saga.console.view")
        topics = [self.status_topic, self.dlq_topic]
        stored = self._store.offsets(topics)
        bounds: dict[tuple[str, int], tuple[int, int]] = {}
        for topic in topics:
            try:
                partitions = consumer.list_partitions(topic)
            except ConfigurationError:
                if topic == self.status_topic:
                    consumer.close()
                    raise
                log.info("no DLQ topic %s: the console lists no dead letters", topic)
                continue
            for p in range(partitions):
                bounds[(topic, p)] = consumer.watermarks(topic, p)
        # A stored offset past a partition's end, or for a partition that no longer
        # exists, means the topics were made anew under the same names: start over.
        stale = [tp for tp, offset in stored.items() if tp not in bounds or offset > bounds[tp][1]]
        if stale:
            log.warning("the stored offsets do not fit the topics (%s): rebuilding the view", stale)
            self._store.reset(topics)
            stored = {}
        self._positions = {tp: max(stored.get(tp, low), low) for tp, (low, _) in bounds.items()}
        self._ends = {
            tp: high
            for tp, (_, high) in bounds.items()
            if tp[0] == self.status_topic and high > self._positions[tp]
        }
        if not self._ends:
            self._caught_up.set()
        consumer.assign([(t, p, offset) for (t, p), offset in self._positions.items()])
        self.health = "ok"
        return consumer

    def step(self, timeout: float = 0.5) -> int:
        """Read and apply one batch; the number of records read."""
        if self._consumer is None:
            self._consumer = self._open()
        batch = self._consumer.poll_batch(2000, timeout)
        if batch:
            self._apply(batch)
        if not self._caught_up.is_set():
            self._check_caught_up(self._consumer)
        return len(batch)

    def _check_caught_up(self, consumer: LogConsumer) -> None:
        positions = consumer.position(list(self._ends))
        if all(
            (pos is not None and pos >= self._ends[tp]) or self._positions[tp] >= self._ends[tp]
            for tp, pos in positions.items()
        ):
            self._caught_up.set()

    def _apply(self, batch: Sequence[Message]) -> None:
        by_key: dict[bytes, list[Message]] = {}
        dead: list[DeadLetter] = []
        offsets: dict[tuple[str, int], int] = {}
        for m in batch:
            offsets[(m.topic, m.partition)] = m.next_offset
            if m.topic == self.dlq_topic:
                dead.append(dead_letter(m))
            elif m.key is not None:  # a status record without a key names no transaction
                by_key.setdefault(m.key, []).append(m)
        upserts: list[SagaStatus] = []
        deletes: list[str] = []
        for key, records in by_key.items():
            found, status = standing_status(records, self._keys, self._forged)
            if not found:
                continue  # nothing believable in this batch: the row keeps what it held
            if status is None:
                tx_id = key.decode("utf-8", "replace")
                if re.fullmatch(TX_ID_PATTERN, tx_id):  # another key names no row
                    deletes.append(tx_id)
            else:
                upserts.append(status)
        self._store.apply(upserts, deletes, dead, offsets)
        self._positions.update(offsets)

    def _forged(self, m: Message, reason: str) -> None:
        self.forged += 1
        log.warning(
            "not believing the status record at %s/%d@%d: %s",
            m.topic,
            m.partition,
            m.offset,
            reason,
        )


def dead_letter(m: Message) -> DeadLetter:
    """The console's row for the DLQ record ``m``; never raises, whatever ``m`` holds."""

    def text(name: str) -> str | None:
        raw = m.header(name)
        return None if raw is None else raw.decode("utf-8", "replace")[:1000]

    def number(name: str) -> int | None:
        raw = text(name)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    value = m.value or b""
    return DeadLetter(
        partition=m.partition,
        offset=m.offset,
        tx_id=m.key.decode("utf-8", "replace")[:200] if m.key is not None else None,
        error=text("saga.error") or "no reason given",
        source_topic=text("saga.source.topic"),
        source_partition=number("saga.source.partition"),
        source_offset=number("saga.source.offset"),
        at_ms=m.timestamp_ms if m.timestamp_ms is not None else int(time.time() * 1000),
        size=len(value),
        excerpt=value[:DLQ_EXCERPT_BYTES].decode("utf-8", "replace"),
    )
