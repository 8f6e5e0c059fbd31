"""The idempotent :class:`Producer` and what both producers share (:class:`_ProducerBase`).

Both producers hash keys with murmur2 (``murmur2_random``), the Java client's
partitioner, so a record re-published by a JVM client lands on the same partition.
The transactional producer is in :mod:`._txn_producer`.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Self

import confluent_kafka as ck

from saga.streams._errors import ConfigurationError, SagaError, TransientError
from saga.streams.kafka._message import (
    DeliveryCallback,
    _to_message,
)
from saga.streams.kafka._settings import KafkaSettings, _client_config
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


Compression = Literal["lz4", "zstd", "gzip", "snappy", "none"]


def _idempotent_config(
    settings: KafkaSettings,
    client_id: str,
    compression: Compression,
    linger_ms: int,
    **more: Any,
) -> dict[str, Any]:
    """Both producers' librdkafka settings: murmur2 keys, ``acks=all``, idempotence on."""
    return _client_config(
        settings,
        client_id=client_id,
        compression_type=compression,
        linger_ms=linger_ms,
        partitioner="murmur2_random",
        acks="all",
        enable_idempotence=True,
        **more,
    )


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
        self, record: _Outgoing, on_delivery: DeliveryCallback | None, resends: int = 0
    ) -> Callable[[ck.KafkaError | None, ck.Message], None]:
        def handle(err: ck.KafkaError | None, raw: ck.Message) -> None:
            message = _to_message(raw)
            error: SagaError | None = None
            if err is not None:
                error = _translate(
                    err,
                    f"delivering a record to {message.topic}",
                    text=err.str(),
                    topic=message.topic,
                    transactional_id=self._transactional_id,
                )
            elif message.offset < 0 and self._transactional_id is None:
                # Acknowledged without an offset: maybe not in the log (see Producer).
                error = self._resend(record, on_delivery, resends)
                if error is None:
                    return  # the next report of the record it sent again says
            else:
                self._delivered += 1
            if on_delivery is not None:
                on_delivery(error, message)
            elif error is not None and self._collect_failures:
                self._failures.append(error)
            if error is not None and self._txn_failure is None and not self._collect_failures:
                self._txn_failure = error

        return handle

    def _resend(
        self, record: _Outgoing, on_delivery: DeliveryCallback | None, resends: int
    ) -> SagaError | None:
        """Send ``record`` again (Kafka acknowledged it without an offset); the error
        its delivery fails with when it cannot be, or when it was sent often enough."""
        where = f"a record to {record.topic}"
        if record.key is not None:
            where += f" keyed {record.key!r}"
        if resends >= _UNPLACED_RESENDS:
            return TransientError(
                f"Kafka acknowledged {where} without an offset {resends + 1} times: "
                "it may not be in the log; send it again"
            )
        _log.warning("Kafka acknowledged %s without an offset; sending it again", where)
        handler = self._delivery_handler(record, on_delivery, resends + 1)
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
        handler = self._delivery_handler(record, on_delivery)
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
        config = _idempotent_config(settings, client_id, compression, linger_ms)
        super().__init__(settings, config, transactional_id=None, collect_failures=True)
