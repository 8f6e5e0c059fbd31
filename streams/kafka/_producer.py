"""The two producers: :class:`Producer` (idempotent) and :class:`TransactionalProducer`.

Both hash keys with murmur2 (``murmur2_random``), the Java client's
partitioner, so a record re-published by a JVM client lands on the same
partition. The transactional producer runs ``send_offsets`` on a thread of its own
and raises :class:`~streams._errors.FatalKafkaError` when it wedges (never returns),
leaving the client behind, or before the call when the client has seen every broker
down since its init (the case that wedges); a watchdog thread reports any other wedged call (and
``send_offsets`` past :data:`_MAX_ABANDONED` clients) to ``on_wedged``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NoReturn, Self, TypeVar

import confluent_kafka as ck

from saga.streams._errors import ConfigurationError, FatalKafkaError, SagaError, TransientError
from saga.streams.kafka._consumer import Consumer
from saga.streams.kafka._message import (
    DeliveryCallback,
    Message,
    Partition,
    _to_message,
    _tps_at,
)
from saga.streams.kafka._settings import TXN_RETRY_BACKOFF_MS, KafkaSettings, _client_config
from saga.streams.kafka._translate import (
    _E,
    _FENCED_CODES,
    TransactionAborted,
    _error_of,
    _log_client_error,
    _severity,
    _translate,
)

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
_BUFFER_FULL_TIMEOUT_S: Final = 30.0
_UNPLACED_RESENDS: Final = 3
"""How often :class:`Producer` sends again a record Kafka acknowledged without an offset."""


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """One record as :meth:`_ProducerBase.produce` was given it (kept to send it again)."""

    topic: str
    key: str | bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] | None
    partition: int | None
    timestamp_ms: int | None


class _ProducerBase:
    """What both producers share: construction, produce with back-pressure, flush, close."""

    def __init__(
        self,
        settings: KafkaSettings,
        config: dict[str, Any],
        *,
        transactional_id: str | None,
        collect_failures: bool,
    ) -> None:
        self._settings = settings
        self._transactional_id = transactional_id
        self._collect_failures = collect_failures
        self._failures: list[SagaError] = []
        # The first delivery failure of the current transaction (transactional only).
        self._txn_failure: SagaError | None = None
        self._delivered = 0
        self._fatal: ck.KafkaError | None = None
        self._closed = False
        self._wedged = False  # a call on the client never returned: the client is left alone
        config["error_cb"] = self._on_client_error
        try:
            self._client = ck.Producer(config)
        except (ck.KafkaException, ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot create a Kafka producer: {exc}") from exc

    def _on_client_error(self, err: ck.KafkaError) -> None:
        if err.fatal():
            self._fatal = err
        _log_client_error(err)

    def _translated(self, exc: ck.KafkaException, doing: str, topic: str | None) -> SagaError:
        err = _error_of(exc)
        if err is not None and (
            err.fatal() or (err.code() in _FENCED_CODES and not err.txn_requires_abort())
        ):
            self._fatal = err
        elif err is not None and err.code() == _E._FATAL and self._fatal is not None:
            # After a fatal error librdkafka answers every call with a bare _FATAL;
            # the error that caused it is the useful one.
            err = self._fatal
        error = _translate(
            err, doing, text=str(exc), topic=topic, transactional_id=self._transactional_id
        )
        if isinstance(error, TransactionAborted) and self._txn_failure is not None:
            # "n message(s) failed delivery" alone does not say why; the record's error does.
            error = TransactionAborted(f"{error} (first failed record: {self._txn_failure})")
        return error

    def _delivery_handler(
        self, on_delivery: DeliveryCallback | None
    ) -> Callable[[ck.KafkaError | None, ck.Message], None]:
        def handle(err: ck.KafkaError | None, raw: ck.Message) -> None:
            message = _to_message(raw)
            error: SagaError | None = None
            if err is None:
                self._delivered += 1
            else:
                error = _translate(
                    err,
                    f"delivering a record to {message.topic}",
                    text=err.str(),
                    topic=message.topic,
                    transactional_id=self._transactional_id,
                )
            if on_delivery is not None:
                on_delivery(error, message)
            elif error is not None and self._collect_failures:
                self._failures.append(error)
            if error is not None and self._txn_failure is None and not self._collect_failures:
                self._txn_failure = error

        return handle

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_delivery: DeliveryCallback | None = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        """Queue one record; it is sent in the background.

        ``partition`` overrides the key's partition: only tools and tests that send a
        record where it does not belong need it (consumers reject such a record).
        ``timestamp_ms`` sets the record's time (default: now), for tools that write
        a history as it would have been written.

        Returns once the record is queued, not delivered. When the local queue
        is full, serves delivery reports and retries for up to 30 s. A str key
        is sent as UTF-8.

        Delivery is reported to ``on_delivery`` when given (it runs inside
        :meth:`poll`, :meth:`flush` or a later :meth:`produce`, and an exception
        it raises comes out of that call). Without it, failures are kept and
        raised by the next :meth:`flush` (plain :class:`Producer`) or surface as
        :class:`TransactionAborted` from ``commit`` (transactional producer).

        A record to a topic that does not exist is queued like any other and
        fails with a time-out after ``message.timeout.ms`` (topic
        auto-creation is off): create the topics first.

        Raises:
            TransientError: the queue stayed full (the broker is not keeping up
                or is unreachable).
            FatalKafkaError: the producer is fenced or in a fatal state.
        """
        record = _Outgoing(topic, key, value, headers, partition, timestamp_ms)
        handler = self._delivery_handler(self._reported(record, on_delivery))
        deadline = time.monotonic() + _BUFFER_FULL_TIMEOUT_S
        while True:
            try:
                self._send_once(record, handler)
                break
            except BufferError:
                if time.monotonic() >= deadline:
                    raise TransientError(
                        f"the producer's queue stayed full for {_BUFFER_FULL_TIMEOUT_S:.0f}s: "
                        f"is Kafka at {self._settings.bootstrap} reachable?"
                    ) from None
                self._client.poll(0.1)
            except ck.KafkaException as exc:
                raise self._translated(exc, f"producing to {topic}", topic) from exc
        # Serve delivery reports (and logs) of earlier records without blocking.
        self._client.poll(0)

    def _reported(
        self, record: _Outgoing, on_delivery: DeliveryCallback | None
    ) -> DeliveryCallback | None:
        """What learns ``record``'s delivery: ``on_delivery`` here (see :class:`Producer`)."""
        return on_delivery

    def _send_once(
        self, record: _Outgoing, handler: Callable[[ck.KafkaError | None, ck.Message], None]
    ) -> None:
        extra: dict[str, Any] = {}
        if record.partition is not None:
            extra["partition"] = record.partition
        if record.timestamp_ms is not None:
            extra["timestamp"] = record.timestamp_ms
        self._client.produce(
            record.topic,
            value=record.value,
            key=record.key,
            headers=list(record.headers) if record.headers else None,
            on_delivery=handler,
            **extra,
        )

    def poll(self, timeout: float = 0.0) -> int:
        """Serve delivery reports for up to ``timeout`` seconds; returns how many ran."""
        return self._client.poll(timeout)

    def flush(self, timeout: float = 30.0) -> int:
        """Wait until every queued record is delivered; returns how many were since the last flush.

        Raises:
            TransientError: records are still undelivered after ``timeout``
                seconds, or some failed to deliver (collected failures, without
                an ``on_delivery`` callback; the most severe one is raised, with
                the count).
            FatalKafkaError: the producer is fenced or in a fatal state (also
                when a collected delivery failure was fatal).
            ConfigurationError: a collected delivery failure was refused
                authorisation.
        """
        try:
            remaining = self._client.flush(timeout)
        except ck.KafkaException as exc:
            raise self._translated(exc, "flushing the producer", None) from exc
        if remaining:
            raise TransientError(
                f"{remaining} record(s) still undelivered after {timeout:g}s: "
                f"is Kafka at {self._settings.bootstrap} reachable?"
            )
        if self._failures:
            failures, self._failures = self._failures, []
            worst = max(failures, key=_severity)
            raise type(worst)(f"{len(failures)} record(s) were not delivered; {worst}")
        delivered, self._delivered = self._delivered, 0
        return delivered

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (for up to ``timeout`` seconds) and release the client.

        Records still queued after ``timeout`` are dropped with a warning; a
        transaction still open is aborted. Never raises; closing twice is a no-op.
        A wedged client (see :class:`TransactionalProducer`) is left as it is.
        """
        if self._closed:
            return
        self._closed = True
        if self._wedged:
            return
        if self._fatal is None:
            try:
                remaining = self._client.flush(timeout)
                if remaining:
                    _log.warning("closing the producer drops %d undelivered record(s)", remaining)
                    self._client.purge()
            except ck.KafkaException as exc:
                _log.warning("closing the producer: %s", exc)
        # confluent-kafka reports a failed abort of the open transaction (always
        # the case for a fenced producer) as a RuntimeWarning; it is expected here.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                self._client.close()
            except (ck.KafkaException, RuntimeError) as exc:
                _log.warning("closing the producer: %s", exc)
        for warning in caught:
            _log.info("closing the producer: %s", warning.message)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


Compression = Literal["lz4", "zstd", "gzip", "snappy", "none"]


class Producer(_ProducerBase):
    """An idempotent producer (``acks=all``, ``enable.idempotence=true``).

    Records with the same key keep their order and are written once even when
    librdkafka retries. Delivery failures are raised by the next :meth:`flush`
    unless :meth:`produce` got an ``on_delivery`` callback.

    A record Kafka acknowledges without an offset is sent again, up to
    :data:`_UNPLACED_RESENDS` times, before it is reported: librdkafka 2.16 was seen
    to report the first records to a partition of a new topic, just after a broker
    restart, as delivered at offset -1 while no such record was in the log. A resent
    record may be in the log twice; every record this product sends is idempotent by
    its key (a request by its ``tx_id``). Still without an offset after the resends,
    its delivery fails with a :class:`TransientError` ("may not be in the log").
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        client_id: str = "saga",
        compression: Compression = "lz4",
        linger_ms: int = 5,
    ) -> None:
        config = _client_config(
            settings,
            client_id=client_id,
            compression_type=compression,
            linger_ms=linger_ms,
            partitioner="murmur2_random",
            acks="all",
            enable_idempotence=True,
        )
        super().__init__(settings, config, transactional_id=None, collect_failures=True)

    def _reported(
        self, record: _Outgoing, on_delivery: DeliveryCallback | None, resends: int = 0
    ) -> DeliveryCallback:
        """The delivery callback that sends ``record`` again when Kafka acknowledged it
        without an offset (see the class docstring), then reports to ``on_delivery``."""

        def report(error: SagaError | None, message: Message) -> None:
            if error is None and message.offset < 0:
                self._delivered -= 1  # not delivered yet: counted when it is
                error = self._resend(record, on_delivery, resends)
                if error is None:
                    return
            if on_delivery is not None:
                on_delivery(error, message)
            elif error is not None:
                self._failures.append(error)

        return report

    def _resend(
        self, record: _Outgoing, on_delivery: DeliveryCallback | None, resends: int
    ) -> SagaError | None:
        where = f"a record to {record.topic}"
        if record.key is not None:
            where += f" keyed {record.key!r}"
        if resends >= _UNPLACED_RESENDS:
            return TransientError(
                f"Kafka acknowledged {where} without an offset {resends + 1} times: "
                "it may not be in the log; send it again"
            )
        _log.warning("Kafka acknowledged %s without an offset; sending it again", where)
        handler = self._delivery_handler(self._reported(record, on_delivery, resends + 1))
        try:  # inside a delivery report: one attempt, no waiting for room in the queue
            self._send_once(record, handler)
        except BufferError:
            return TransientError(
                f"Kafka acknowledged {where} without an offset and the producer's queue "
                "is full: it may not be in the log; send it again"
            )
        except ck.KafkaException as exc:
            return self._translated(exc, f"producing to {record.topic}", record.topic)
        return None


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
        config = _client_config(
            settings,
            client_id=client_id,
            compression_type=compression,
            linger_ms=linger_ms,
            partitioner="murmur2_random",
            acks="all",
            enable_idempotence=True,
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
