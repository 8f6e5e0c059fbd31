"""The coordinator's transactional producer, and how a failed transaction is ridden through.

A batch's transaction can fail in four ways after a Kafka broker fails over (all
seen on the three-broker chaos profile); none of them needs the process to exit:

* **abortable** (:class:`~streams.kafka.TransactionAborted`, incl. librdkafka's
  KIP-360 epoch bump after ``INVALID_PRODUCER_EPOCH``): abort, rewind the
  consumer to the batch's first records, process them again;
* **transient before the commit** (``begin``/``produce``/``send_offsets`` timed
  out, e.g. ``AddOffsetsToTxn`` while the transaction coordinator moves): the
  commit was never asked for, so the transaction cannot have committed: abort,
  rewind, process again. If the abort fails too, reset (below);
* **fatal** (e.g. ``INVALID_TXN_STATE`` ending a transaction the new transaction
  coordinator had already aborted), **a wedged client** (``send_offsets`` never
  returned, librdkafka #5456: the client is left behind), **or a commit whose
  outcome is unknown** (it timed out): reset;
* **fenced** (``FatalKafkaError.fenced``): librdkafka folds a broker-side epoch
  bump (the broker aborted the transaction, e.g. across a transaction coordinator
  failover) and a real fence (a newer instance initialised the same
  ``transactional.id``) into one error code, so the consumer group is asked: a
  newer instance also takes over the static group membership (same
  ``group.instance.id``), which Kafka reports to this consumer as an instance
  fence within a heartbeat. The consumer rides a first instance fence through by
  rejoining (streams._rejoin: librdkafka fences a member by its own id after some
  broker faults), so a fence counts here whether it raised or was ridden through:
  a consumer that rejoined since the last committed transaction, or is fenced
  within :data:`FENCE_CHECK_S`, means this instance is the zombie, and it stops
  (raises): zombie fencing is what keeps exactly-once. Otherwise, reset.

**Reset** is a restart inside the process, keeping the group membership: a new
producer with the same ``transactional.id`` (``init`` bumps the epoch, which
fences the old producer, and makes the broker finish whatever the old one left:
a commit it had written completes, anything else aborts), then the owned
partitions' state is rebuilt from the status topic and the consumer is moved to
the group's committed offsets, exactly as after a restart. Kafka alone says
whether the failed batch committed: nothing in memory is trusted for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Final, TypeVar

from saga.streams import FatalKafkaError, SagaError, TransientError
from saga.streams.kafka import OFFSET_BEGINNING, Message, TransactionAborted
from saga.streams.log import LogConsumer, LogTransactionalProducer

log = logging.getLogger("saga.coordinator")

FENCE_CHECK_S: Final = 3.0
"""How long a fenced producer's consumer is polled (paused) for a fatal "replaced by a newer
member" error: three heartbeats at the default 6 s session (heartbeat a sixth of it)."""
_INIT_WITHIN_S: Final = 60.0
T = TypeVar("T")
"""How long a new producer keeps retrying ``init`` (a leader election takes seconds)."""


class Transactions:
    """Owns the coordinator's transactional producer and replaces it when it cannot go on.

    ``make_producer`` makes a producer with the instance's ``transactional.id``;
    ``reload`` rebuilds the owned partitions' state from the status topic
    (CoordinatorService._reload); a reset then moves ``consumer`` to the group's
    committed offsets.
    """

    def __init__(
        self,
        make_producer: Callable[[], LogTransactionalProducer],
        consumer: LogConsumer,
        reload: Callable[[], None],
    ) -> None:
        self._make_producer = make_producer
        self._consumer = consumer
        self._reload = reload
        self.producer = make_producer()
        self.resets = 0
        self._rejoins_seen = consumer.rejoins  # as of the last committed transaction

    def committed(self) -> None:
        """Note that a transaction committed: the consumer's rejoins so far were not a fence."""
        self._rejoins_seen = self._consumer.rejoins

    def init(self) -> None:
        """Initialise the current producer, retrying transient errors for up to a minute."""
        retrying("initialising Kafka transactions", self.producer.init)

    def failed(self, error: SagaError, rewind: Callable[[], None], *, committing: bool) -> None:
        """Leave the service ready for its next batch after its transaction raised ``error``.

        ``committing``: ``error`` came from the commit itself (its outcome is unknown
        unless the error is :class:`TransactionAborted`). See the module docstring.

        Raises:
            FatalKafkaError: a newer instance replaced this one (a real fence), or the
                reset could not bring up a new producer or consumer state.
        """
        known_aborted = isinstance(error, TransactionAborted) or (
            isinstance(error, TransientError) and not committing
        )
        if known_aborted:
            try:
                self.producer.abort()
            except SagaError as exc:
                log.warning("aborting the failed transaction failed too (%s); resetting", exc)
                error = exc
            else:
                rewind()
                return
        if isinstance(error, FatalKafkaError) and error.fenced:
            if self._replaced():
                raise error
            error = FatalKafkaError(
                "the broker refused the transactional producer's epoch, but no newer instance "
                f"took this one's place in the group within {FENCE_CHECK_S:g}s: the epoch was "
                "bumped by the broker (a transaction it aborted itself), not by a newer instance",
                fenced=True,
            )
        self._reset(error)

    def _replaced(self) -> bool:
        """Whether a newer instance took this one's group membership (it is a zombie).

        Polls the consumer with every partition paused: records a rebalance brings in
        meanwhile are dropped here and read again after the reset's seek.
        """
        if self._rejoined():
            return True
        deadline = time.monotonic() + FENCE_CHECK_S
        try:
            self._consumer.pause_all()
            while True:
                self._consumer.poll_batch(100, max(min(0.5, deadline - time.monotonic()), 0.0))
                if time.monotonic() >= deadline:
                    break
            self._consumer.resume_all()
        except FatalKafkaError as exc:
            log.error("a newer instance replaced this one in the group: %s", exc)
            return True
        except TransientError as exc:  # pausing or resuming met the fence: it rejoined
            log.warning("polling the group: %s", exc)
        return self._rejoined()

    def _rejoined(self) -> bool:
        if self._consumer.rejoins == self._rejoins_seen:
            return False
        log.error(
            "a newer instance replaced this one in the group: its consumer was fenced by "
            "its instance id since the last committed transaction"
        )
        return True

    def _reset(self, cause: SagaError) -> None:
        log.warning(
            "the transactional producer cannot go on (%s): making a new one and reloading "
            "the owned partitions from Kafka, as a restart would",
            cause,
        )
        self.resets += 1
        self.producer.close(1.0)
        self.producer = self._make_producer()
        self.init()
        self._reload()
        self._seek_committed()
        self._rejoins_seen = self._consumer.rejoins

    def _seek_committed(self) -> None:
        """Read on from the group's committed offsets: what Kafka says the log holds.

        Retried for up to a minute: the group coordinator may be moving too. Never
        skipped: read on from where the failed batch left, the consumer would lose
        its records if the transaction did not commit.
        """

        def seek() -> None:
            committed = self._consumer.committed(self._consumer.assignment(), timeout=30)
            for (topic, p), offset in committed.items():
                self._consumer.seek(topic, p, OFFSET_BEGINNING if offset is None else offset)

        retrying("reading the committed offsets", seek)


def rewind(consumer: LogConsumer, messages: Iterable[Message], owned: Collection[int]) -> None:
    """Move ``consumer`` back to the first of ``messages`` on each partition still ``owned``
    (an aborted batch is read again)."""
    first: dict[tuple[str, int], int] = {}
    for m in messages:
        key = (m.topic, m.partition)
        if key not in first or m.offset < first[key]:
            first[key] = m.offset
    try:
        for (topic, partition), offset in first.items():
            if partition in owned:
                consumer.seek(topic, partition, offset)
    except TransientError as exc:  # a rejoin (streams._rejoin) lost every partition
        log.warning("rewinding the batch: %s", exc)


def await_previous_owner(
    consumer: LogConsumer, topics: Iterable[str], partitions: Iterable[int]
) -> None:
    """Wait until no transaction of a previous owner of ``partitions`` is pending.

    An instance that has not learnt yet that it lost them may still commit a
    transaction: status records, and the offsets past the inputs they account
    for. Restored before it commits, the state would lack what those offsets skip
    (a saga whose request it had read stayed undecided for good; found by the
    chaos suite). A read_committed consumer reads committed offsets only once no
    transaction is pending on them, so this waits for it to be resolved.
    """
    wanted = [(t, p) for t in topics for p in partitions]
    try:
        consumer.committed(wanted, timeout=60)
    except TransientError as exc:
        log.warning("could not wait for the partitions' previous owner: %s", exc)


def next_offsets(messages: Iterable[Message]) -> dict[tuple[str, int], int]:
    """The offset to commit per (topic, partition): one past the last message read."""
    offsets: dict[tuple[str, int], int] = {}
    for m in messages:
        key = (m.topic, m.partition)
        offsets[key] = max(offsets.get(key, 0), m.offset + 1)
    return offsets


def retrying(
    what: str, call: Callable[[], T], *, within_s: float = _INIT_WITHIN_S, max_delay_s: float = 2.0
) -> T:
    """``call()``, retried on transient errors with exponential backoff (from 0.25 s up
    to ``max_delay_s``) for up to ``within_s``; the last error is raised."""
    deadline = time.monotonic() + within_s
    delay = 0.25
    while True:
        try:
            return call()
        except TransientError as exc:
            if time.monotonic() + delay >= deadline:
                raise
            log.warning("%s: %s; retrying in %.2gs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)
