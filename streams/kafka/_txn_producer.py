"""The :class:`TransactionalProducer`: records and consumer offsets, atomically.

It runs ``send_offsets`` on a thread of its own and raises
:class:`~streams._errors.FatalKafkaError` when it wedges (never returns), leaving the
client behind, or before the call when the client has seen every broker down since
its init (the case that wedges); a watchdog thread reports any other wedged call (and
``send_offsets`` past :data:`_MAX_ABANDONED` clients) to ``on_wedged``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn, TypeVar

import confluent_kafka as ck

from saga.streams._errors import ConfigurationError, FatalKafkaError, TransientError
from saga.streams.kafka._consumer import Consumer
from saga.streams.kafka._message import Partition, _tps_at
from saga.streams.kafka._producer import Compression, _idempotent_config, _ProducerBase
from saga.streams.kafka._settings import TXN_RETRY_BACKOFF_MS, KafkaSettings
from saga.streams.kafka._translate import _E, _FENCED_CODES, _error_of

_log = logging.getLogger("saga.kafka")

_T = TypeVar("_T")

_TXN_ATTEMPTS: Final = 5
_WEDGED_AFTER_S: Final = 3.0
"""How long past its own timeout a transactional call may run before the client is wedged.

Short, because a wedged coordinator holds its partitions until it exits: its restart
(same ``transactional.id``, same static group membership) takes them back at once."""
_MAX_ABANDONED: Final = 3
"""Wedged clients a process leaves behind (see :class:`_Worker`) before the next one
makes it exit: each holds its threads and sockets for good."""
_abandoned: list[Any] = []  # never released: destroying a wedged client blocks the caller
_SEND_OFFSETS_S: Final = 5.0
"""The longest :meth:`TransactionalProducer.send_offsets` waits. A healthy call takes
milliseconds, and a second or two while a restarted broker loads its coordinators; one
that times out costs its caller one batch (abort, rewind, again). It is the call that
wedges after a broker restart (librdkafka #5456 and #5511), so its bound plus
:data:`_WEDGED_AFTER_S` is how long a wedged coordinator holds its partitions before it
exits to be restarted: the chaos suite measured 15 s of it with the transaction timeout
as the bound."""


class TransactionalProducer(_ProducerBase):
    """A producer that writes records and consumer offsets atomically (docs/architecture.md §5).

    Use::

        producer.init()                      # once; fences older instances
        producer.begin()
        producer.produce(...)                # any number
        producer.send_offsets(consumer, {("saga.events", 3): last_offset + 1})
        producer.commit()

    ``transactional.id`` must be stable for the role and partition set of the
    process: a restarted instance with the same id fences the old one (which
    then gets :class:`~streams._errors.FatalKafkaError` on its next call) and
    aborts its open transaction.

    Error contract of :meth:`init`, :meth:`send_offsets`, :meth:`commit` and
    :meth:`abort`: errors librdkafka calls retriable are retried a few times
    with a short backoff, then raised as :class:`~streams._errors.TransientError`;
    ``txn_requires_abort`` raises :class:`TransactionAborted`; fencing and fatal
    errors raise :class:`~streams._errors.FatalKafkaError`; anything else
    raises :class:`~streams._errors.TransientError`.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        transactional_id: str,
        *,
        client_id: str = "saga",
        compression: Compression = "lz4",
        linger_ms: int = 5,
        transaction_timeout_ms: int = 60_000,
        on_wedged: Callable[[str], None] | None = None,
    ) -> None:
        if not transactional_id:
            raise ConfigurationError("a transactional producer needs a transactional.id")
        config = _idempotent_config(
            settings,
            client_id,
            compression,
            linger_ms,
            transactional_id=transactional_id,
            transaction_timeout_ms=transaction_timeout_ms,
        )
        if "retry.backoff.ms" not in settings.extra:
            config["retry.backoff.ms"] = TXN_RETRY_BACKOFF_MS
        # Every broker was seen down (the client's error callback) after init: see send_offsets.
        self._outage = False
        self._initialised = False
        super().__init__(
            settings, config, transactional_id=transactional_id, collect_failures=False
        )
        # (what, monotonic deadline) while a transactional call runs: see _watch.
        self._busy: tuple[str, float] | None = None
        # The broker aborts a transaction older than this: a call inside one that has
        # not returned by then will not bring it to commit (see _in_transaction).
        self._txn_timeout_s = transaction_timeout_ms / 1000
        self._on_wedged = on_wedged
        self._worker: _Worker | None = None
        threading.Thread(target=self._watch, name="saga-txn-watchdog", daemon=True).start()

    def _on_client_error(self, err: ck.KafkaError) -> None:
        if err.code() == _E._ALL_BROKERS_DOWN and self._initialised:
            self._outage = True
        super()._on_client_error(err)

    def _watch(self) -> None:
        """Report a transactional call that outlives its timeout by far to ``on_wedged``.

        librdkafka does not always honour the timeout of its transactional calls:
        after a broker restart ``send_offsets_to_transaction`` can block for good
        (librdkafka issues #5456 and #5511; found by the chaos suite). The call
        cannot be interrupted and the client cannot be used again. This thread only
        reports it (once); the process decides: the command line exits with status
        1, as on a fatal error, and the restarted instance fences this one's
        ``transactional.id`` and aborts its open transaction.
        """
        while not self._closed:
            busy = self._busy
            if busy is not None and time.monotonic() > busy[1]:
                message = (
                    f"{busy[0]} has not returned {_WEDGED_AFTER_S:.0f}s after its timeout: "
                    "the Kafka client is wedged (librdkafka issue #5456)"
                )
                _log.critical("%s", message)
                if self._on_wedged is not None:
                    self._on_wedged(message)
                return
            time.sleep(1.0)

    @property
    def transactional_id(self) -> str:
        """The id that identifies this producer across restarts (and fences older instances)."""
        assert self._transactional_id is not None
        return self._transactional_id

    def _in_transaction(self, timeout: float) -> float:
        """The timeout of a call inside a transaction: at most the transaction timeout.

        After a broker restart such a call could otherwise wait its whole timeout (and
        then some, wedged) on a transaction the broker aborts anyway; the chaos suite
        measured a minute of idle partitions for it.
        """
        return min(timeout, self._txn_timeout_s)

    def _call(self, doing: str, operation: Callable[[float], _T], timeout: float) -> _T:
        """Run ``operation(remaining seconds)``, retrying retriable errors within ``timeout``."""
        deadline = time.monotonic() + timeout
        self._busy = (doing, deadline + _WEDGED_AFTER_S)
        try:
            return self._attempts(doing, operation, timeout, deadline)
        finally:
            self._busy = None

    def _attempts(
        self, doing: str, operation: Callable[[float], _T], timeout: float, deadline: float
    ) -> _T:
        attempt = 1
        while True:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                return operation(remaining)
            except ck.KafkaException as exc:
                err = _error_of(exc)
                retry = (
                    err is not None
                    and err.retriable()
                    and not err.fatal()
                    and not err.txn_requires_abort()
                    and err.code() not in _FENCED_CODES
                )
                if not retry:
                    raise self._translated(exc, doing, None) from exc
                if attempt >= _TXN_ATTEMPTS or time.monotonic() >= deadline:
                    raise TransientError(
                        f"{doing} did not succeed within {timeout:g}s ({attempt} attempts): "
                        f"{err.str() if err else exc}; "
                        f"is Kafka at {self._settings.bootstrap} reachable?"
                    ) from exc
                _log.info("%s: %s; retrying (attempt %d)", doing, exc, attempt)
                time.sleep(min(0.1 * 2 ** (attempt - 1), 1.0, max(deadline - time.monotonic(), 0)))
                attempt += 1

    def init(self, timeout: float = 30.0) -> None:
        """Register the ``transactional.id``: fences older instances, aborts their open transaction.

        Call once, before anything else.
        """
        self._call("initialising Kafka transactions", self._client.init_transactions, timeout)
        self._client.poll(0)  # brokers unreachable while it started are not an outage
        self._initialised = True

    def begin(self) -> None:
        """Start a transaction; every record produced until commit/abort belongs to it."""
        self._txn_failure = None
        self._call("beginning a Kafka transaction", lambda _: self._client.begin_transaction(), 5.0)

    def _offsets_worker(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker("saga-send-offsets")
        return self._worker

    def send_offsets(
        self,
        consumer: Any,
        offsets: Mapping[Partition, int],
        timeout: float = 30.0,
    ) -> None:
        """Make committing ``offsets`` for ``consumer``'s group part of this transaction.

        Each offset is the **next offset to read**: the offset of the last
        record processed on that partition + 1 (:attr:`Message.next_offset`),
        not the offset of the last record. The offsets are committed if and
        only if the transaction commits. The consumer's current group metadata
        goes with them, so the broker refuses offsets from a consumer that was
        left behind by a rebalance (a zombie); the transaction must then be
        aborted. The broker checks the group generation, not which partitions
        the consumer owns: leave out partitions it no longer owns. An empty
        mapping does nothing. It waits at most ``timeout``, the transaction timeout and
        5 s, whichever is least (:data:`_SEND_OFFSETS_S`).

        Raises:
            ValueError: a negative offset (librdkafka would ignore it silently).
        """
        if not offsets:
            return
        for partition, offset in offsets.items():
            if offset < 0:
                raise ValueError(f"offset {offset} for {partition} is not a position")
        if not isinstance(consumer, Consumer):
            raise TypeError("send_offsets needs the Kafka Consumer whose group the offsets are for")
        positions = _tps_at(offsets)
        try:
            metadata = consumer._client.consumer_group_metadata()
        except ck.KafkaException as exc:
            raise self._translated(exc, "reading the consumer group metadata", None) from exc
        doing = "sending offsets to the Kafka transaction"
        bound = min(self._in_transaction(timeout), _SEND_OFFSETS_S)
        self._client.poll(0)  # serve the client's pending events: an outage seen meanwhile
        if self._outage and len(_abandoned) < _MAX_ABANDONED:  # the call would wedge: go now
            self._leave_behind(
                f"the Kafka client saw every broker down before {doing}", logging.WARNING
            )

        def call() -> None:
            self._attempts(
                doing,
                lambda left: self._client.send_offsets_to_transaction(positions, metadata, left),
                bound,
                time.monotonic() + bound,
            )

        if len(_abandoned) >= _MAX_ABANDONED:  # no more clients to leave behind: the watchdog
            self._call(doing, lambda _: call(), bound)
            return
        if self._offsets_worker().run(call, bound + _WEDGED_AFTER_S):
            return
        self._leave_behind(
            f"{doing} has not returned {_WEDGED_AFTER_S:.0f}s after its timeout: the Kafka "
            "client is wedged (librdkafka issue #5456)"
        )

    def _leave_behind(self, why: str, level: int = logging.ERROR) -> NoReturn:
        """Never touch this client again (nor flush or destroy it) and raise, so that the
        caller makes a new producer with the same ``transactional.id``, which fences it."""
        self._wedged = True
        _abandoned.append(self._client)
        _log.log(
            level,
            "%s; leaving it and making a new producer (%d of %d)",
            why,
            len(_abandoned),
            _MAX_ABANDONED,
        )
        raise FatalKafkaError(why)

    def commit(self, timeout: float = 30.0) -> None:
        """Deliver the transaction's records and commit it (records and offsets at once)."""
        self._call(
            "committing the Kafka transaction",
            self._client.commit_transaction,
            self._in_transaction(timeout),
        )

    def abort(self, timeout: float = 30.0) -> None:
        """Abort the transaction: its records stay invisible to ``read_committed`` readers.

        Records still queued locally are dropped without being sent; those
        already on the broker are marked aborted. Offsets sent with
        :meth:`send_offsets` are not committed. Call :meth:`begin` next.
        """
        self._call("aborting the Kafka transaction", self._client.abort_transaction, timeout)


class _Worker:
    """A daemon thread that runs the calls handed to it, so that the caller can stop
    waiting for one that never returns (a wedged librdkafka call cannot be interrupted;
    the thread stays blocked in it, and the process still exits without joining it)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stuck = False
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def run(self, call: Callable[[], None], wait_s: float) -> bool:
        """Run ``call`` on the thread: true when it returned (or raised, which is raised
        here) within ``wait_s``, false when it is still running (it is left running)."""
        if self._stuck:
            return False
        done = threading.Event()
        outcome: list[BaseException | None] = []

        def job() -> None:
            try:
                call()
                outcome.append(None)
            except BaseException as exc:  # handed to the waiting caller
                outcome.append(exc)
            finally:
                done.set()

        self._jobs.put(job)
        if not done.wait(wait_s):
            self._stuck = True
            return False
        if outcome[0] is not None:
            raise outcome[0]
        return True
